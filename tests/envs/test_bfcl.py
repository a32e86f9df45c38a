"""BFCL multi-turn as built-in envs: BFCL's entries, simulators and function docs, scored by BFCL's own
multi-turn checker. No model is needed: scripted policies drive the episodes."""

from __future__ import annotations

import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

import miles.envs as E
from miles.envs.bfcl import CATEGORIES, entries, parse_call, score, tool_schema
from miles.types import Message, ToolCall

pytest.importorskip("bfcl_eval", reason="the BFCL envs need `pip install --no-deps bfcl-eval`")


def _number(task_id: str) -> int:
    return int(task_id.rsplit("_", 1)[1])


@pytest.mark.parametrize("env_id", sorted(CATEGORIES))
def test_the_ground_truth_scores_1_on_every_entry_as_bfcl_itself_scores_it(env_id):
    """The oracle replays each entry's ground truth through the env (one call per step); the env's reward is
    BFCL's checker on what ran, and BFCL's checker on the ground-truth strings themselves agrees."""
    env = E.make(env_id)
    assert len(env.tasks) == 200
    for task in env.tasks:
        result = E.run_episode(env, seed=0, options={"task": task})
        entry, truth = entries(env.category)[task.id]
        own = score(entry, truth, [[turn] if turn else [] for turn in truth])
        assert result.reward == 1.0 and result.success and result.info["bfcl"] == {"valid": True}, task.id
        assert own["valid"], task.id
    env.close()


def test_a_policy_that_never_calls_a_tool_scores_0_on_every_base_entry():
    env = E.make("BFCL-MultiTurn-v0")
    for task in env.tasks:
        result = E.run_episode(
            env, lambda messages: Message("assistant", "Sure, done."), options={"task": task}
        )
        assert result.reward == 0.0 and result.info["termination"] == "done"
        assert result.info["bfcl"]["error_type"] == "multi_turn:empty_turn_model_response"
        users = [m for m in result.messages if m.role == "user"]
        assert len(users) == len(entries("multi_turn_base")[task.id][0]["question"])  # every user turn came


def test_bad_calls_become_tool_errors_and_the_session_goes_on():
    env = E.make("BFCL-MultiTurn-v0")
    task = env.tasks.get("multi_turn_base_0")
    messages, _ = env.reset(options={"task": task})
    assert messages == [Message("user", task.prompt)]
    bad = Message(
        "assistant",
        tool_calls=[
            ToolCall(
                "cd",
                None,
                "c0",
                raw_arguments="{folder: ",
                parse_error="invalid JSON: Expecting property name",
            ),
            ToolCall("rm_rf_everything", {"path": "/"}, "c1"),
            ToolCall("__import__", {"name": "os"}, "c2"),
            ToolCall("cd", {"folder": "no_such_dir"}, "c3"),
            ToolCall("cd", {"folder": "document", "bogus": 1}, "c4"),
            ToolCall("cd", {"folder": "document"}, "c5"),
        ],
    )
    obs, reward, terminated, truncated, info = env.step(bad)
    assert not (terminated or truncated) and reward == 0.0
    assert [m.tool_call_id for m in obs] == ["c0", "c1", "c2", "c3", "c4", "c5"]
    assert obs[0].content.startswith("Error: could not parse the tool call 'cd'")
    assert obs[1].content.startswith("Error: unknown tool 'rm_rf_everything'. Available tools: ")
    assert obs[2].content.startswith("Error: unknown tool '__import__'")
    assert obs[3].content == '{"error": "cd: \'no_such_dir\': No such file or directory"}'  # BFCL's simulator
    assert obs[4].content.startswith("Error during execution: ")  # BFCL's executor: an unexpected keyword
    assert obs[5].content == '{"current_working_directory": "document"}'
    assert info["tool_errors"]["invalid_json"] == 1 and info["tool_errors"]["unknown_tool"] == 2
    obs, reward, terminated, truncated, info = env.step(Message("assistant", "I moved into document."))
    assert obs[0].role == "user" and not terminated  # the next user turn arrives
    env.close()


def test_more_steps_in_one_turn_than_bfcl_allows_force_quits_the_episode():
    env = E.make("BFCL-MultiTurn-v0", max_steps_per_turn=3)
    env.reset(options={"task": env.tasks.get("multi_turn_base_0")})
    step = Message("assistant", tool_calls=[ToolCall("pwd", {}, "p")])
    outcomes = [env.step(step) for _ in range(4)]
    assert [o[2] for o in outcomes] == [False, False, False, True]
    info = outcomes[-1][4]
    assert info["stop_reason"] == "force_quit" and outcomes[-1][1] == 0.0
    assert info["bfcl"]["error_type"] == "multi_turn:force_terminated"


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_the_reward_is_bfcls_verdict_on_the_calls_that_ran(data):
    """A policy that drops some ground-truth calls: the env's reward equals BFCL's checker run directly on the
    calls the policy made, whatever was dropped."""
    env = E.make("BFCL-MultiTurn-v0")
    task_id = data.draw(st.sampled_from(sorted(entries("multi_turn_base"))))
    entry, truth = entries("multi_turn_base")[task_id]
    keep = [[data.draw(st.booleans()) for _ in turn] for turn in truth]
    plan = [[c for c, k in zip(turn, ks, strict=True) if k] for turn, ks in zip(truth, keep, strict=True)]
    state = {"turn": 0, "step": 0}

    def policy(messages: list[Message]) -> Message:
        calls = plan[state["turn"]]
        if state["step"] < len(calls):
            state["step"] += 1
            return Message("assistant", tool_calls=[parse_call(calls[state["step"] - 1], entry)])
        state["turn"], state["step"] = state["turn"] + 1, 0
        return Message("assistant", "Done.")

    result = E.run_episode(env, policy, options={"task": env.tasks.get(task_id)})
    executed = [[[call] for call in turn] for turn in plan]
    assert result.reward == float(score(entry, truth, executed)["valid"])
    assert result.reward == (1.0 if plan == truth else result.reward)
    env.close()


def test_variants_of_an_entry_share_its_split_and_the_split_is_deterministic():
    held = {env_id: {_number(t.id) for t in E.make(env_id, split="held_out").tasks} for env_id in CATEGORIES}
    train = {env_id: {_number(t.id) for t in E.make(env_id, split="train").tasks} for env_id in CATEGORIES}
    base = held["BFCL-MultiTurn-v0"]
    assert all(h == base for h in held.values()) and 40 <= len(base) <= 60
    assert all(t == set(range(200)) - base for t in train.values())
    assert base == {_number(t.id) for t in E.make("BFCL-MultiTurn-v0", split="held_out").tasks}


def test_a_held_out_function_arrives_listed_in_bfcls_holdout_turn():
    env = E.make("BFCL-MultiTurn-MissFunc-v0")
    task = env.tasks.get("multi_turn_miss_func_0")
    entry, truth = entries("multi_turn_miss_func")[task.id]
    held_turn, held = next(iter(entry["missed_function"].items()))
    env.reset(options={"task": task})
    names = {t["function"]["name"] for t in env.tool_schemas()}
    assert not names & {f["name"] for f in held}
    oracle = env.oracle()
    for _ in range(50):
        obs, _, terminated, _, _ = env.step(oracle.act(env.messages))
        if obs and obs[0].role == "user" and env.state["turn"] == int(held_turn):
            break
    assert obs[0].content.endswith("I have updated some more functions you can choose from. What about now?")
    assert all(f'"name": "{f["name"]}"' in obs[0].content for f in held)
    assert {f["name"] for f in held} <= {t["function"]["name"] for t in env.tool_schemas()}
    env.close()


def test_schemas_are_json_schema_and_the_env_passes_gymnasiums_checker():
    for entry, _ in list(entries("multi_turn_base").values())[:20]:
        for doc in entry["function"]:
            params = tool_schema(doc)["function"]["parameters"]
            assert params["type"] == "object"
            assert {p["type"] for p in params["properties"].values()} <= {
                "string",
                "number",
                "integer",
                "boolean",
                "array",
                "object",
            }
    env = E.make("BFCL-MultiTurn-v0")
    check_env(env, skip_render_check=True)
    env.close()


def test_sft_then_grpo_on_bfcl_through_miles_then_replay_and_eval_per_category(tmp_path, capsys):
    """`miles train` on BFCL-MultiTurn-v0 (oracle SFT demos from the train split only, then GRPO) with the tiny
    model; every recorded session re-checks with `miles replay --check`; `miles eval --run` gives the held-out
    table per BFCL category."""
    import json

    from miles.cli import main
    from miles.sessions.recorder import read_sessions

    run = tmp_path / "run"
    cfg = tmp_path / "bfcl.yaml"
    cfg.write_text(
        json.dumps(
            {
                "output_dir": str(run),
                "steps": 1,
                "env": {"id": "BFCL-MultiTurn-v0"},
                "model": {"name": "tiny", "size": "0.1m", "chat_template": "compact"},
                "rollout": {
                    "tasks_per_step": 2,
                    "scheduler": {
                        "group_size": 2,
                        "session": {"max_turns": 4, "sampling": {"max_new_tokens": 16}},
                    },
                },
                "sft": {"enabled": True, "num_demos": 8, "batch_size": 8, "lr": 0.003},
                "eval": {"num_tasks": 2, "envs": ["BFCL-MultiTurn-MissFunc-v0"]},
                "health": {"no_signal_steps": 0},
            }
        )
    )
    assert main(["train", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "[sft] 8 oracle demos" in out and "after RL      BFCL-MultiTurn-MissFunc-v0/greedy" in out
    held_out = {t.id for t in E.make("BFCL-MultiTurn-v0", split="held_out").tasks}
    trained = read_sessions(run / "sessions.jsonl").records
    assert trained and not {r.task["options"]["task"]["id"] for r in trained} & held_out
    for name in ("sessions.jsonl", "eval_sessions.jsonl"):
        assert main(["replay", str(run / name), "--check"]) == 0
    capsys.readouterr()
    assert main(["eval", "--config", str(cfg), "--run", str(run), "--output-dir", str(tmp_path / "ev")]) == 0
    table = capsys.readouterr().out
    assert "multi_turn_base" in table and "multi_turn_miss_func" in table and "overall/greedy" in table
    assert "weights: " + str(run / "checkpoints") in table
    report = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert set(report["results"]) == {"BFCL-MultiTurn-v0/greedy", "BFCL-MultiTurn-MissFunc-v0/greedy"}
