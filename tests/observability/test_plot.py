"""curves.png: sessions assigned to steps by their end time, per-step distributions, and the extra row of
panels (reward distribution, turn latency) when the run recorded sessions."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from miles.sessions import Recorder, SessionRecord, TurnRecord
from miles.training.plot import plot_run, reward_edges, sessions_by_step, step_histograms
from miles.types import TerminationReason


def record(
    i: int, end: float, reward: float, latency: float, termination=TerminationReason.DONE
) -> SessionRecord:
    turn = TurnRecord(index=0, finish_reason="stop", generate_s=latency)
    return SessionRecord(
        session_id=f"s{i}",
        started_at=end - 1.0,
        duration_s=1.0,
        reward=reward,
        turns=[turn],
        termination=termination,
    )


def test_sessions_belong_to_the_step_that_ended_after_them():
    recs = [
        record(0, 10.0, 0, 0.1),
        record(1, 10.5, 1, 0.1),
        record(2, 19.0, 1, 0.1),
        record(3, 25.0, 1, 0.1),
        record(4, 12.0, 0, 0.1, TerminationReason.ABORTED),
    ]
    steps = sessions_by_step(recs, [10.5, 20.0])
    assert [[r.session_id for r in s] for s in steps] == [["s0", "s1"], ["s2"]]  # s3: after the last step


@given(st.lists(st.lists(st.floats(-2, 3), max_size=20), min_size=1, max_size=10))
def test_step_histograms_are_shares_of_each_step(values):
    flat = [x for v in values for x in v] or [0.0]
    edges = reward_edges(flat)
    grid = step_histograms(values, edges)
    for j, v in enumerate(values):
        assert grid[:, j].sum() == pytest.approx(1.0 if v else 0.0)


def test_few_distinct_rewards_get_a_bin_each():
    edges = reward_edges([0.0, 1.0, 0.5, 1.0])
    assert np.histogram([0.0, 0.5, 1.0], bins=edges)[0].tolist() == [1, 1, 1]


async def test_curves_gain_the_distribution_panels_when_sessions_were_recorded(tmp_path):
    rows = [
        {
            "kind": "train",
            "step": i,
            "time": 10.0 * (i + 1),
            "rollout_reward_mean": 0.5,
            "rollout_success_rate": 0.5,
        }
        for i in range(3)
    ]
    rows.append({"kind": "eval", "step": 3, "time": 40.0, "mode": "greedy", "success_rate": 0.5})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain = plot_run(tmp_path / "metrics.jsonl", tmp_path / "plain.png")
    recorder = Recorder(tmp_path / "sessions.jsonl")
    for i in range(12):
        await recorder.append(record(i, 10.0 * (i // 4) + 5.0, float(i % 2), 0.01 * (i + 1)))
    await recorder.aclose()
    full = plot_run(tmp_path / "metrics.jsonl", tmp_path / "full.png")
    assert Image.open(full).height == 2 * Image.open(plain).height  # a second row of panels
