"""Orders-v0: stateful tools over a per-episode sqlite DB, policy rules, goal-state reward."""

from __future__ import annotations

import pytest
from gymnasium.utils.env_checker import check_env

import miles.envs as E
from miles.envs.orders import load_seed_data
from miles.types import Message, ToolCall


def calls(*specs) -> Message:
    return Message("assistant", tool_calls=[ToolCall(n, a, f"call_{i}") for i, (n, a) in enumerate(specs)])


def task_where(env, pred):
    return next(t for t in env.tasks if pred(t))


def auth(task):
    return ("authenticate", {"email": task.data["email"], "zip_code": task.data["zip"]})


@pytest.fixture()
def env():
    e = E.make("Orders-v0")
    yield e
    e.close()


def test_oracle_solves_every_task_and_tasks_cover_both_outcomes(env):
    results = [E.run_episode(env, options={"task": t}) for t in env.tasks]
    assert all(r.success for r in results), [r.info["task_id"] for r in results if not r.success]
    changed = [t for t in env.tasks if t.answer]
    assert 5 < len(changed) < len(env.tasks)  # some requests must be refused by policy


def test_each_episode_starts_from_a_fresh_db(env):
    t = task_where(env, lambda t: t.answer and t.data["requests"][0]["action"] == "cancel")
    E.run_episode(env, options={"task": t})
    env.reset(options={"task": t})
    oid = t.data["requests"][0]["order_id"]
    assert env.state["db"].snapshot()[oid][0] != "cancelled"


def test_must_authenticate_first(env):
    t = task_where(env, lambda t: t.answer)
    oid = next(iter(t.answer))
    env.reset(options={"task": t})
    obs, *_ = env.step(calls(("get_order", {"order_id": oid}), ("refund_order", {"order_id": oid})))
    assert all("policy violation" in m.content and "authenticate" in m.content for m in obs)
    _, r, _, _, info = env.step("Done!")
    assert r == 0.0 and len(info["policy_violations"]) == 2 and info["reward_components"]["db_match"] == 0.0


def test_cannot_cancel_shipped_or_refund_undelivered(env):
    t = task_where(env, lambda t: not t.answer and t.data["zip"] != "00000")
    req = t.data["requests"][0]
    env.reset(options={"task": t})
    env.step(calls(auth(t)))
    status = env.state["db"].snapshot()[req["order_id"]][0]
    action = {
        "cancel": ("cancel_order", {"order_id": req["order_id"], "reason": "no longer needed"}),
        "refund": ("refund_order", {"order_id": req["order_id"]}),
        "change_address": ("change_address", {"order_id": req["order_id"], "address": "1 Main St"}),
    }
    obs, *_ = env.step(calls(action[req["action"]]))
    assert "policy violation" in obs[0].content and status in obs[0].content
    assert env.state["db"].snapshot() == env.state["initial"]  # refused: nothing changed
    _, r, _, _, info = env.step("Sorry, I cannot do that.")
    assert r == 0.0 and info["reward_components"] == {
        "goal": 0.0,
        "db_match": 1.0,
        "no_violations": 0.0,
        "diligence": 0.0,
    }


def test_doing_nothing_scores_zero_even_when_the_policy_forbids_every_request(env):
    refusals = [t for t in env.tasks if not t.answer]
    assert refusals
    for t in refusals:
        env.reset(options={"task": t})
        _, r, terminated, _, info = env.step("\n\n")
        assert terminated and r == 0.0 and info["reward_components"]["db_match"] == 1.0
        assert info["reward_components"]["diligence"] == 0.0


def test_cannot_touch_another_customers_order(env):
    t = env.tasks.get("orders-001")
    other = env.tasks.get("orders-002").data["requests"][0]["order_id"]
    env.reset(options={"task": t})
    obs, *_ = env.step(calls(auth(t), ("get_order", {"order_id": other})))
    assert "does not belong" in obs[1].content and env.state["db"].violations


def test_wrong_identity_is_not_authenticated(env):
    t = task_where(env, lambda t: t.data["zip"] == "00000")
    env.reset(options={"task": t})
    obs, *_ = env.step(calls(auth(t), ("get_user_details", {})))
    assert obs[0].content.startswith("Error") and "policy violation" in obs[1].content


def test_doing_nothing_or_too_much_fails_the_goal(env):
    t = task_where(env, lambda t: t.answer)
    env.reset(options={"task": t})
    _, r, *_ = env.step("Hello! How can I help?")
    assert r == 0.0
    # The requested change plus an unrequested cancellation breaks the goal state.
    orders = load_seed_data()["orders"]
    t = task_where(
        env,
        lambda t: (
            t.answer
            and any(
                o["status"] in ("pending", "processing")
                and o["id"] not in t.answer
                and o["user_id"] == next(x["user_id"] for x in orders if x["id"] == next(iter(t.answer)))
                for o in orders
            )
        ),
    )
    owner = next(x["user_id"] for x in orders if x["id"] == next(iter(t.answer)))
    extra = next(
        o["id"]
        for o in orders
        if o["user_id"] == owner and o["status"] in ("pending", "processing") and o["id"] not in t.answer
    )
    oracle = env.oracle()
    obs, _ = env.reset(options={"task": t})
    messages = list(obs)
    while True:
        action = oracle.act(messages)
        if not action.tool_calls:  # before answering, do one unrequested change
            env.step(calls(("cancel_order", {"order_id": extra, "reason": "ordered by mistake"})))
            break
        obs, *_ = env.step(action)
        messages += [action, *obs]
    _, r, _, _, info = env.step("Done.")
    assert r == 0.0 and info["reward_components"]["db_match"] == 0.0 and not info["policy_violations"]


def test_schema_violations_are_tool_errors(env):
    t = task_where(env, lambda t: t.data["zip"] != "00000")
    env.reset(options={"task": t})
    obs, _, term, _, info = env.step(
        calls(
            auth(t),
            ("cancel_order", {"order_id": "W1000", "reason": "bored"}),
            ("authenticate", {"email": "x"}),
        )
    )
    assert not term and info["tool_errors"]["schema_violation"] == 2
    assert "db" not in str(env.tool_schemas())  # the injected DB is hidden from the schema


def test_check_env():
    check_env(E.make("Orders-v0"), skip_render_check=True)
