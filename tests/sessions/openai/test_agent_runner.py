"""External agents as a rollout source: real agent processes (the shipped `examples/openai_agent.py`, and small
stdlib agents) run once per session against the endpoint; the runner returns GRPO groups like the scheduler,
scored by the env's reward hooks or by the agent's `/reward`; timeouts, crashes and stops end sessions with a
named reason and are recorded."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest

from miles.config import ConfigError, from_dict
from miles.envs import EnvRecipe
from miles.sessions.instant import InstantEngine
from miles.sessions.openai.agent import AgentRollout
from miles.sessions.openai.config import AgentConfig
from miles.sessions.recorder import Recorder, read_sessions
from miles.sessions.replay import check_tito
from miles.types import Message, TerminationReason
from tests.support.openai import call, tito

ROOT = Path(__file__).resolve().parents[3]
RECIPE = EnvRecipe("Calculator-v0", {"max_operand": 9, "operators": "+-*"})


def calculator_model(wrong_for: str = "") -> InstantEngine:
    """A scripted stand-in for the model: it calls `calculate` with the question's expression, then reports
    the tool's result (sessions whose id ends with `wrong_for` report one more)."""
    t = tito("tiny")

    def respond(input_ids: list[int], session_id: str | None, k: int) -> list[int]:
        text = t.decode(input_ids)
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)
        if not results:
            expression = re.findall(r"What is (.*?)\?", text)[-1]
            reply = Message("assistant", "", [call("calculate", f'{{"expression": "{expression}"}}')])
        else:
            value = int(results[-1]) + (1 if wrong_for and str(session_id).endswith(wrong_for) else 0)
            reply = Message("assistant", f"The answer is {value}.")
        return t.expected_generation([Message("user", "q")], reply)

    return InstantEngine(respond=respond)


def agent_file(tmp_path: Path, name: str, body: str) -> str:
    """A small agent script using only the standard library (fast to start)."""
    path = tmp_path / f"{name}.py"
    path.write_text(
        textwrap.dedent("""\
        import json, os, sys, time, urllib.request
        BASE, KEY = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
        SID, TASK = os.environ["MILES_SESSION_ID"], json.loads(os.environ["MILES_TASK"])
        def post(url, body, key=None):
            req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json",
                                         "authorization": "Bearer " + (key or KEY)})
            return json.loads(urllib.request.urlopen(req, timeout=30).read())
        def chat(messages):
            return post(BASE + "/chat/completions", {"model": "m", "messages": messages, "tools": TASK["tools"]})
        """)
        + textwrap.dedent(body)
    )
    return f"{sys.executable} {path}"


def config(command: str, **kw) -> AgentConfig:
    return from_dict(AgentConfig, {"command": command, "max_concurrent": 4, **kw})


async def test_the_example_agent_runs_groups_scored_by_the_env(tmp_path):
    t = tito("tiny")
    cfg = config(f"{sys.executable} {ROOT / 'examples' / 'openai_agent.py'}", sampling={"temperature": 1.0})
    service = await AgentRollout.start(
        calculator_model(wrong_for="s1"), tokenizer=t, config=cfg, log_dir=tmp_path / "logs"
    )
    recorder = Recorder(tmp_path / "sessions.jsonl")
    tasks = RECIPE.make().tasks.take(2)
    runner = service.runner(recipe=RECIPE, group_size=2, seed=5, recorder=recorder, run_id="train")
    try:
        groups = await runner.run([{"task": task} for task in tasks], num_groups=2)
    finally:
        await runner.aclose()
        await service.aclose()
        await recorder.aclose()
    assert sorted(g.group_id for g in groups) == ["train-g0", "train-g1"]
    records = [r for g in groups for r in g.records]
    assert all(len(g.records) == 2 and [r.sample_index for r in g.records] == [0, 1] for g in groups)
    assert all(r.termination is TerminationReason.DONE and r.error is None for r in records)
    by_id = {r.session_id: r for r in records}
    assert by_id["train-s1"].reward == 0.0 and not by_id["train-s1"].final_info["success"]  # one wrong answer
    for sid in ("train-s0", "train-s2", "train-s3"):
        assert by_id[sid].reward == 1.0 and by_id[sid].final_info["success"]
        assert by_id[sid].final_info["reward_source"] == "env"
    for r in records:
        env = RECIPE.make()
        messages, _ = await env.areset(
            seed=r.seed, options={"task": next(x for x in tasks if x.id == r.task["task_id"])}
        )
        assert r.initial_messages == [m.to_dict() for m in messages]  # the agent got the env's own prompt
        assert r.tools[0]["function"]["name"] == "calculate" and r.recipe == RECIPE
        assert r.seed == 5 + int(r.session_id.removeprefix("train-s")) and r.group_id.startswith("train-g")
        assert len(r.turns) == 2 and check_tito(r, t).ok and r.trajectory.num_generated > 0
        assert r.trajectory.meta.group_id == r.group_id
    assert sorted(r.session_id for r in read_sessions(tmp_path / "sessions.jsonl").records) == sorted(by_id)
    assert not any((tmp_path / "logs").iterdir())  # logs of sessions that ended well are not kept


async def test_timeouts_crashes_and_silent_agents_end_with_named_reasons(tmp_path):
    t = tito("tiny")
    pid_file = tmp_path / "child.pid"
    slow = agent_file(
        tmp_path,
        "slow",
        f"""\
        import subprocess
        child = subprocess.Popen(["sleep", "300"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        chat(TASK["messages"])
        time.sleep(300)
        """,
    )
    crash = agent_file(
        tmp_path,
        "crash",
        """\
        chat(TASK["messages"])
        print("something broke", flush=True)
        sys.exit(3)
        """,
    )
    silent = agent_file(tmp_path, "silent", "print('nothing to do')\n")
    task = RECIPE.make().tasks.take(1)[0]
    outcomes = {}
    # only the slow agent meets its timeout, long enough for its Python to start and chat once on a busy box
    for name, command, timeout_s in (
        ("slow", slow, 12.0),
        ("crash", crash, 300.0),
        ("silent", silent, 300.0),
    ):
        service = await AgentRollout.start(
            calculator_model(),
            tokenizer=t,
            config=config(command, timeout_s=timeout_s),
            log_dir=tmp_path / name,
        )
        try:
            [group] = await service.runner(recipe=RECIPE, run_id=name).run([{"task": task}])
        finally:
            await service.aclose()
        outcomes[name] = group.records[0]
    slow_rec, crash_rec, silent_rec = outcomes["slow"], outcomes["crash"], outcomes["silent"]
    assert slow_rec.termination is TerminationReason.TIMEOUT and slow_rec.error.type == "AgentTimeout"
    assert len(slow_rec.turns) == 1 and slow_rec.trajectory.num_generated > 0 and slow_rec.reward == 0.0
    child = int(pid_file.read_text())
    for _ in range(50):  # the agent's own child was killed with it
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the agent's child {child} outlived the timeout")
    assert crash_rec.termination is TerminationReason.ENV_ERROR and crash_rec.error.type == "AgentCrashed"
    assert "exited with code 3" in crash_rec.error.message and "something broke" in crash_rec.error.message
    assert len(crash_rec.turns) == 1 and (tmp_path / "crash" / "crash-s0.log").exists()  # kept: it failed
    assert silent_rec.termination is TerminationReason.ENV_ERROR and silent_rec.error.type == "NoRequests"


async def test_the_agents_reward_wins_unless_the_env_scores(tmp_path):
    t = tito("tiny")
    agent = agent_file(
        tmp_path,
        "rewarding",
        """\
        reply = chat(TASK["messages"])["choices"][0]["message"]
        root = BASE.removesuffix("/v1")
        try:
            post(f"{root}/sessions/{SID}/reward", {"components": {"style": 0.25, "correct": 0.5}})
        except urllib.error.HTTPError as err:
            print(err.code, json.loads(err.read())["error"]["code"])
        """,
    )
    task = RECIPE.make().tasks.take(1)[0]
    results = {}
    for mode in ("auto", "env"):
        service = await AgentRollout.start(
            calculator_model(),
            tokenizer=t,
            config=config(agent, reward=mode, keep_logs=True),
            log_dir=tmp_path / mode,
        )
        try:
            [group] = await service.runner(recipe=RECIPE, run_id=mode).run([{"task": task}])
        finally:
            await service.aclose()
        results[mode] = group.records[0]
    auto, env = results["auto"], results["env"]
    assert auto.reward == 0.75 and auto.reward_components == {"style": 0.25, "correct": 0.5}
    assert auto.final_info["reward_source"] == "client"
    # env mode: the agent's post is refused (409) and the env scores the session: it stopped after a tool call
    assert "409 reward_from_env" in (tmp_path / "env" / "env-s0.log").read_text()
    assert env.final_info["reward_source"] == "env" and env.reward == 0.0
    assert env.final_info["stop_reason"] == "agent_stopped_early"


async def test_stopping_a_run_kills_the_agents_and_records_their_sessions(tmp_path):
    t = tito("tiny")
    agent = agent_file(tmp_path, "stuck", 'chat(TASK["messages"])\ntime.sleep(300)\n')
    service = await AgentRollout.start(
        calculator_model(), tokenizer=t, config=config(agent), log_dir=tmp_path / "logs"
    )
    recorder = Recorder(tmp_path / "sessions.jsonl")
    runner = service.runner(recipe=RECIPE, group_size=2, recorder=recorder)
    run = asyncio.ensure_future(runner.run([{"task": task} for task in RECIPE.make().tasks.take(2)]))
    async with asyncio.timeout(120):  # every agent is stuck after its first turn
        while service.endpoint.stats.completions < 4:
            await asyncio.sleep(0.05)
    await runner.aclose()
    with pytest.raises(asyncio.CancelledError):
        await run
    await service.aclose()
    await recorder.aclose()
    records = read_sessions(tmp_path / "sessions.jsonl").records
    assert len(records) == 4 and {r.termination for r in records} == {TerminationReason.ABORTED}
    assert all(len(r.turns) == 1 and r.error.where == "agent" for r in records)


def test_agent_config_errors_name_the_key():
    assert not AgentConfig().enabled
    for data, words in (
        ({"command": "python a.py {model}"}, "unknown placeholder {model}"),
        ({"command": "no-such-program-xyz {base_url}"}, "is not a program"),
        ({"command": "python 'unclosed"}, "cannot split"),
        ({"command": "python a.py", "timeout_s": 0}, "timeout_s"),
        ({"command": "python a.py", "session": {"parser": "nope"}}, "session.parser"),
        ({"command": "python a.py", "reward": "judge"}, "reward"),
    ):
        with pytest.raises(ConfigError, match=re.escape(words)):
            from_dict(AgentConfig, data, "rollout.agent")
    argv = from_dict(AgentConfig, {"command": "python agent.py --url {base_url} --key={api_key}"}).argv(
        base_url="http://h/v1", api_key="s-1", session_id="s-1", task_id="t", task_file="f"
    )
    assert argv == ["python", "agent.py", "--url", "http://h/v1", "--key=s-1"]


@pytest.mark.slow
def test_miles_train_trains_the_example_agent_through_the_endpoint(tmp_path):
    import json
    import subprocess

    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "miles.cli",
            "train",
            "--config",
            str(ROOT / "configs" / "openai_agent.yaml"),
            "--set",
            "steps=1",
            "--set",
            "eval.num_tasks=4",
            "--set",
            "rollout.tasks_per_step=2",
            "--set",
            "rollout.scheduler.group_size=2",
            "--set",
            f"output_dir={out}",
            "--set",
            f"rollout.agent.command={sys.executable} examples/openai_agent.py",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[eval start] greedy: success" in proc.stdout and "held-out success" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_done"] == 1 and set(summary["evals"]) == {"start", "final"}
    train = read_sessions(out / "sessions.jsonl").records
    evals = read_sessions(out / "eval_sessions.jsonl").records
    assert len(train) == 4 and len(evals) == 8
    assert {r.final_info["reward_source"] for r in train + evals} == {"env"}
    assert all(
        r.final_info["tito"]["special_tokens"] == r.final_info["tito"]["non_assistant_text"] == 0
        for r in train + evals
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("rollout_reward_mean" in r for r in rows)


async def test_an_agent_can_reach_only_its_own_session(tmp_path):
    """Session ids are predictable (`run-s0`, `run-s1`, ...); the credential is each session's own token. A rogue
    agent that knows its sibling's id can neither read its trajectory, nor send its turns, nor score or close
    it, nor talk with a made-up key; the sibling's session ends as its own agent left it."""
    t = tito("tiny")
    agent = agent_file(
        tmp_path,
        "rogue",
        """\
        import urllib.error
        root = BASE.removesuffix("/v1")
        other = SID[:-1] + ("1" if SID.endswith("0") else "0")
        if SID.endswith("0"):
            attempts = {
                "read": lambda: urllib.request.urlopen(urllib.request.Request(
                    f"{root}/sessions/{other}/trajectory", headers={"authorization": "Bearer " + KEY}), timeout=30),
                "turn": lambda: post(f"{root}/sessions/{other}/v1/chat/completions",
                                     {"model": "m", "messages": TASK["messages"]}),
                "reward": lambda: post(f"{root}/sessions/{other}/reward", {"reward": 1.0}),
                "close": lambda: post(f"{root}/sessions/{other}/close", {}),
                "guess": lambda: post(BASE + "/chat/completions", {"model": "m", "messages": TASK["messages"]},
                                      key=other),
            }
            for name, attempt in attempts.items():
                try:
                    attempt()
                    print(name, "ALLOWED")
                except urllib.error.HTTPError as err:
                    print(name, err.code)
        reply = chat(TASK["messages"])["choices"][0]["message"]
        """,
    )
    task = RECIPE.make().tasks.take(1)[0]
    service = await AgentRollout.start(
        calculator_model(),
        tokenizer=t,
        config=config(agent, reward="env", keep_logs=True),
        log_dir=tmp_path / "logs",
    )
    try:
        [group] = await service.runner(recipe=RECIPE, run_id="run", group_size=2).run([{"task": task}])
    finally:
        await service.aclose()
    log = (tmp_path / "logs" / "run-s0.log").read_text()
    assert log.split() == ["read", "403", "turn", "403", "reward", "403", "close", "403", "guess", "401"], log
    victim = next(r for r in group.records if r.session_id == "run-s1")
    assert victim.termination is TerminationReason.DONE and len(victim.turns) == 1
    assert victim.final_info["reward_source"] == "env"


async def test_an_agent_runs_the_envs_own_tools_through_its_session(tmp_path):
    """A stateful env's tools are the env's, not the agent's: `POST /sessions/{id}/tools/{name}` runs them in the
    session's own episode (Orders-v0's database of this task), answered as the env answers the model; a bad call
    gets the env's error message; another session's token is refused."""
    t = tito("tiny")
    agent = agent_file(
        tmp_path,
        "orders",
        """\
        import re, urllib.error
        root = BASE.removesuffix("/v1")
        email, zip_code = re.search(r"\\(([^,]+), zip code (\\d+)\\)", TASK["prompt"]).groups()
        order = re.search(r"order (W\\d+)", TASK["prompt"]).group(1)
        for name, args in (("authenticate", {"email": email, "zip_code": zip_code}),
                           ("get_order", {"order_id": order}), ("teleport", {}), ("get_order", {"order_id": 7})):
            print(name, json.dumps(post(f"{root}/sessions/{SID}/tools/{name}", args)))
        try:
            post(f"{root}/sessions/{SID}/tools/get_order", {"order_id": order}, key="not-the-token")
        except urllib.error.HTTPError as err:
            print("stranger", err.code)
        chat(TASK["messages"])
        """,
    )
    recipe = EnvRecipe("Orders-v0")
    task = recipe.make().tasks.take(1)[0]
    replies = InstantEngine([t.encode("I will look into it.") + [t.close_token_id]])
    service = await AgentRollout.start(
        replies, tokenizer=t, config=config(agent, reward="env", keep_logs=True), log_dir=tmp_path / "logs"
    )
    try:
        [group] = await service.runner(recipe=recipe, run_id="o").run([{"task": task}])
    finally:
        await service.aclose()
    lines = (tmp_path / "logs" / "o-s0.log").read_text().splitlines()
    answers = {
        line.split(" ", 1)[0] + str(i): json.loads(line.split(" ", 1)[1]) for i, line in enumerate(lines[:4])
    }
    assert "authenticated" in answers["authenticate0"]["content"].lower(), answers
    order = re.search(r"order (W\d+)", task.prompt).group(1)
    assert order in answers["get_order1"]["content"] and "status" in answers["get_order1"]["content"]
    assert answers["teleport2"]["content"].startswith("Error: unknown tool 'teleport'")
    assert answers["get_order3"]["content"].startswith("Error: invalid arguments for tool 'get_order'")
    assert lines[4] == "stranger 401"
    assert group.records[0].termination is TerminationReason.DONE


async def test_replay_check_of_agent_sessions_compares_the_env_tool_results_and_the_envs_reward(tmp_path):
    """`miles replay --check` on agent sessions: a result the env's tool route gave is marked `env` and named
    after its call (the agent's tool message carries no name), and compared with what the env answers on
    replay; the agent's own result, and an agent that stops after a tool call without answering, are the
    agent's business. Changing a recorded env result, or the env-scored reward, is a divergence."""
    from dataclasses import replace

    from miles.sessions.replay import check

    t = tito("tiny")
    agent = agent_file(
        tmp_path,
        "route",
        """\
        root = BASE.removesuffix("/v1")
        messages = list(TASK["messages"])
        for _ in range(3):
            message = chat(messages)["choices"][0]["message"]
            messages.append(message)
            if not message.get("tool_calls") or SID.endswith("s1"):
                break  # s1 stops after its first tool call, never sending its result
            for c in message["tool_calls"]:
                body = json.loads(c["function"]["arguments"])
                content = post(f"{root}/sessions/{SID}/tools/{c['function']['name']}", body)["content"]
                if SID.endswith("s2"):
                    content = str(int(content) + 1)  # the agent answers the call itself, and wrongly
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": content})
        """,
    )
    recorder = Recorder(tmp_path / "sessions.jsonl")
    service = await AgentRollout.start(
        calculator_model(), tokenizer=t, config=config(agent, reward="env"), log_dir=tmp_path / "logs"
    )
    runner = service.runner(recipe=RECIPE, group_size=3, run_id="a", recorder=recorder)
    try:
        [group] = await runner.run([{"task": RECIPE.make().tasks.take(1)[0]}])
    finally:
        await runner.aclose()
        await service.aclose()
        await recorder.aclose()
    records = {r.session_id: r for r in read_sessions(tmp_path / "sessions.jsonl").records}
    assert sorted(records) == ["a-s0", "a-s1", "a-s2"]
    results = {sid: r.turns[0].tool_results for sid, r in records.items()}
    assert [(x["name"], x.get("env")) for x in results["a-s0"]] == [("calculate", True)]
    assert results["a-s1"] == [] and [x.get("env") for x in results["a-s2"]] == [None]
    assert records["a-s0"].reward == 1.0 and records["a-s2"].reward == 0.0
    for record in records.values():
        res = await check(record)
        assert res.ok and res.steps == len(record.turns), (record.session_id, res)
    s0 = records["a-s0"]
    tampered = replace(s0.turns[0], tool_results=[{**results["a-s0"][0], "content": "41"}])
    res = await check(replace(s0, turns=[tampered, *s0.turns[1:]]))
    assert res.divergence is not None and res.divergence.field == "env tool result"
    res = await check(replace(s0, reward=0.0))
    assert res.divergence is not None and res.divergence.field == "final reward"
