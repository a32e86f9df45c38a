"""`miles top`: histogram quantiles as Prometheus computes them, one frame of a real /metrics endpoint, and
rates between live frames."""

from __future__ import annotations

import io

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, ProcessCollector
from rich.console import Console

from miles.cli import main as cli_main
from miles.observability import Metrics, RunLabels, RunMetrics, serve_metrics
from miles.observability.top import histogram_quantile, metrics_url, run_top
from miles.sessions import SessionRecord, TurnRecord
from miles.sessions.metrics import SessionMetrics
from miles.types import TerminationReason
from miles.weight_sync import SyncReport

LABELS = RunLabels(run="r", env="E-v0", model="tiny")


def test_quantiles_interpolate_inside_buckets_like_prometheus():
    buckets = [(0.1, 0.0), (1.0, 10.0), (10.0, 20.0), (float("inf"), 20.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(1.0)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1 + 0.9 * 0.5)
    assert histogram_quantile(0.75, buckets) == pytest.approx(1.0 + 9.0 * 0.5)
    assert (
        histogram_quantile(0.99, [(1.0, 1.0), (float("inf"), 10.0)]) == 1.0
    )  # the +Inf bucket: highest bound
    assert histogram_quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None


@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.floats(0, 1), st.floats(0, 1))
def test_quantiles_are_monotone_and_within_the_bounds(counts, q1, q2):
    bounds = [0.5 * 2**i for i in range(len(counts))]
    cumulative, total = [], 0
    for le, c in zip(bounds, counts, strict=True):
        total += c
        cumulative.append((le, float(total)))
    cumulative.append((float("inf"), float(total)))
    a, b = histogram_quantile(min(q1, q2), cumulative), histogram_quantile(max(q1, q2), cumulative)
    if total == 0:
        assert a is None and b is None
    else:
        assert 0.0 <= a <= b <= bounds[-1]


def test_metrics_url_forms():
    assert metrics_url("127.0.0.1:9400") == "http://127.0.0.1:9400/metrics"
    assert metrics_url("http://h:1/") == "http://h:1/metrics"
    assert metrics_url("http://h:1/metrics") == "http://h:1/metrics"


def feed(m: Metrics, sessions: int, seconds: float) -> None:
    obs = SessionMetrics(LABELS, metrics=m)
    for i in range(sessions):
        turn = TurnRecord(
            index=0,
            engine_id="e0",
            finish_reason="stop",
            generate_s=seconds,
            output_end=7,
            assistant={"role": "assistant"},
        )
        obs.observe(
            SessionRecord(
                session_id=f"s{i}",
                env_id="E-v0",
                turns=[turn],
                duration_s=seconds,
                reward=1.0,
                termination=TerminationReason.DONE,
            )
        )


def test_once_prints_a_frame_of_a_live_endpoint(capsys, monkeypatch):
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    m = Metrics(registry)
    feed(m, 4, 0.3)
    run = RunMetrics(LABELS, metrics=m)
    run.observe_step(
        {
            "step_s": 2.0,
            "rollout_s": 1.5,
            "train_s": 0.5,
            "mismatch_kl": 0.02,
            "mismatch_kl_max": 0.5,
            "rollout_reward_mean": 0.75,
        }
    )
    run.observe_sync(
        SyncReport(
            version=5, method="in_process", seconds=0.1, drain_seconds=0.0, num_bytes=3 << 20, num_engines=1
        )
    )
    server = serve_metrics(m, "127.0.0.1", 0)
    monkeypatch.setenv("COLUMNS", "200")
    try:
        assert cli_main(["top", f"127.0.0.1:{server.port}", "--once"]) == 0
    finally:
        server.close()
    out = capsys.readouterr().out
    assert "4 (done 4)" in out  # sessions ended, by termination
    assert "375 ms / 475 ms" in out  # turn latency p50 / p90 of four 0.3 s turns: interpolated in (0.25, 0.5]
    assert "0.02 / 0.5" in out  # rollout-trainer KL mean / max
    assert "75.0% / 25.0%" in out  # trainer idle / rollout idle
    assert "3.0 MiB" in out and "policy version" in out
    assert "resident memory" in out


def test_live_frames_show_rates_from_consecutive_scrapes():
    m = Metrics(CollectorRegistry())
    feed(m, 2, 0.05)
    server = serve_metrics(m, "127.0.0.1", 0)
    frames = []

    def sleep(_: float) -> None:  # between scrapes: 10 more sessions end, then stop after the second frame
        frames.append(1)
        if len(frames) == 1:
            feed(m, 10, 2.0)
            return
        raise KeyboardInterrupt

    console = Console(file=io.StringIO(), width=200, force_terminal=False)
    try:
        assert run_top(f"127.0.0.1:{server.port}", console=console, sleep=sleep, interval=0.0) == 0
    finally:
        server.close()
    text = console.file.getvalue()  # a non-terminal console keeps the last frame
    assert "12 (done 12)" in text and "totals since start" not in text
    rate = next(line for line in text.splitlines() if "sessions/s" in line)
    assert float(rate.strip("│ ").split("│")[-1]) > 0
    # the window since the previous scrape holds only the 10 slow sessions: p50 1 + 1.5 * 5/10 in (1, 2.5];
    # over all 12 it would be 1.6 s
    assert "1.75 s / 2.35 s / 2.49 s" in text


def test_unreachable_endpoint_is_one_line(capsys):
    assert cli_main(["top", "127.0.0.1:1", "--once"]) == 2
    assert "miles top: cannot read http://127.0.0.1:1/metrics" in capsys.readouterr().out
