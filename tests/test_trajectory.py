"""Trajectory invariants and lossless JSON / safetensors round trips."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.trajectory import Trajectory, TrajectoryBatch, TrajectoryInvariantError, TrajectoryMeta, TurnSpan
from miles.types import Message, TerminationReason, ToolCall

_floats = st.floats(allow_nan=False, allow_infinity=False, width=64)
_text = st.text(max_size=20)


@st.composite
def tool_calls(draw):
    if draw(st.booleans()):
        args = draw(st.dictionaries(st.sampled_from("abc"), st.integers() | _text, max_size=3))
        raw = draw(st.sampled_from([json.dumps(args), json.dumps(args, separators=(",", ":")), ""]))
        return ToolCall(name=draw(_text), arguments=args, id=draw(_text), raw_arguments=raw)
    raw = draw(st.one_of(_text, st.just('{"a": 1}')))  # unparsed even though it is valid JSON
    return ToolCall(
        name=draw(_text),
        arguments=None,
        id=draw(_text),
        raw_arguments=raw,
        parse_error=draw(st.one_of(st.none(), _text)),
    )


@st.composite
def messages(draw):
    return Message(
        role=draw(st.sampled_from(["system", "user", "assistant", "tool"])),
        content=draw(_text),
        tool_calls=draw(st.lists(tool_calls(), max_size=2)),
        tool_call_id=draw(st.one_of(st.none(), _text)),
        name=draw(st.one_of(st.none(), _text)),
        reasoning=draw(st.one_of(st.none(), _text)),
    )


@st.composite
def trajectories(draw):
    traj = Trajectory()
    for k in range(draw(st.integers(0, 5))):
        ids = draw(st.lists(st.integers(0, 2**31 - 1), max_size=12))
        generated = draw(st.booleans())
        lps = [draw(st.floats(-50, 0, allow_nan=False)) for _ in ids] if generated else None
        traj.append(
            ids,
            role="assistant" if generated else "observation",
            generated=generated,
            logprobs=lps,
            weight_version=k if generated else None,
        )
    traj.reward = draw(_floats)
    traj.reward_components = draw(st.dictionaries(_text, _floats, max_size=3))
    traj.termination = draw(st.one_of(st.none(), st.sampled_from(list(TerminationReason))))
    traj.meta = TrajectoryMeta(
        env_id=draw(_text),
        task_id=draw(_text),
        seed=draw(st.one_of(st.none(), st.integers())),
        group_id=draw(_text),
        sample_index=draw(st.integers(0, 64)),
        session_id=draw(_text),
        sampling_params={"temperature": draw(_floats), "stop_token_ids": [1, 2]},
    )
    traj.messages = draw(st.lists(messages(), max_size=4))
    return traj


@given(trajectories())
@settings(max_examples=100, deadline=None)
def test_json_round_trip_is_lossless(traj):
    line = traj.to_json()
    assert "\n" not in line
    back = Trajectory.from_json(line)
    assert back == traj
    assert back.to_json() == line


@given(st.lists(trajectories(), min_size=1, max_size=5))
@settings(max_examples=25, deadline=None)
def test_batch_safetensors_round_trip(tmp_path_factory, trajs):
    path = tmp_path_factory.mktemp("batch") / "b.safetensors"
    batch = TrajectoryBatch.from_trajectories(trajs)
    batch.save(path)
    back = TrajectoryBatch.load(path)
    for name in ("token_ids", "loss_mask", "rollout_logprobs", "cu_seqlens", "rewards", "group_ids"):
        a, b = getattr(batch, name), getattr(back, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert back.meta == batch.meta
    assert back.num_sequences == len(trajs)
    for i, t in enumerate(trajs):
        sl = back.sequence(i)
        assert back.token_ids[sl].tolist() == t.token_ids
        assert back.loss_mask[sl].tolist() == [float(m) for m in t.loss_mask]
        assert (
            back.rollout_logprobs[sl].tolist()
            == torch.tensor(t.rollout_logprobs, dtype=torch.float32).tolist()
        )


def test_group_ids_follow_first_appearance():
    trajs = [Trajectory(meta=TrajectoryMeta(group_id=g)) for g in ["b", "a", "b", "", "a", ""]]
    batch = TrajectoryBatch.from_trajectories(trajs)
    assert batch.group_ids.tolist() == [0, 1, 0, 2, 1, 3]  # ungrouped trajectories get their own group


def test_length_mismatch_is_rejected():
    with pytest.raises(TrajectoryInvariantError, match="lengths differ"):
        Trajectory(token_ids=[1, 2], loss_mask=[0], rollout_logprobs=[0.0, 0.0])


def test_mask_values_and_masked_logprobs_are_checked():
    with pytest.raises(TrajectoryInvariantError, match="not 0 or 1"):
        Trajectory(token_ids=[1], loss_mask=[2], rollout_logprobs=[0.0])
    with pytest.raises(TrajectoryInvariantError, match="masked-out"):
        Trajectory(token_ids=[1], loss_mask=[0], rollout_logprobs=[-0.5])


def test_spans_must_be_ordered_and_inside():
    with pytest.raises(TrajectoryInvariantError, match="span"):
        Trajectory(
            token_ids=[1, 2], loss_mask=[0, 0], rollout_logprobs=[0.0, 0.0], spans=[TurnSpan("a", 0, 3)]
        )
    with pytest.raises(TrajectoryInvariantError, match="span"):
        Trajectory(
            token_ids=[1, 2],
            loss_mask=[0, 0],
            rollout_logprobs=[0.0, 0.0],
            spans=[TurnSpan("a", 1, 2), TurnSpan("b", 0, 1)],
        )


def test_generated_tokens_need_one_logprob_each():
    traj = Trajectory()
    with pytest.raises(TrajectoryInvariantError, match="logprob"):
        traj.append([1, 2], role="assistant", generated=True, logprobs=[-0.1])
    with pytest.raises(TrajectoryInvariantError, match="logprob"):
        traj.append([1], role="assistant", generated=True)
    assert len(traj) == 0


def test_append_records_spans_and_mask():
    traj = Trajectory()
    traj.append([5, 6], role="prompt", generated=False)
    span = traj.append(
        [7, 8, 9], role="assistant", generated=True, logprobs=[-1.0, -2.0, -3.0], weight_version=4
    )
    assert span == TurnSpan("assistant", 2, 5, 4)
    assert traj.loss_mask == [0, 0, 1, 1, 1] and traj.num_generated == 3
    assert traj.rollout_logprobs == [0.0, 0.0, -1.0, -2.0, -3.0]
    traj.check()
