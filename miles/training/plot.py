"""The run's PNG plot: training reward and success per step, held-out success at each evaluation, and, from
the recorded sessions, the reward distribution and the turn-latency distribution of every step."""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import numpy as np

from miles.sessions.recorder import read_sessions
from miles.sessions.records import SessionRecord
from miles.training.metrics_log import read_metrics
from miles.types import TerminationReason


def sessions_by_step(records: list[SessionRecord], step_ends: list[float]) -> list[list[SessionRecord]]:
    """The records of each step: a session belongs to the first step that ended after it did (a step's
    metrics row is written once all its sessions have ended). Aborted sessions (over-sampling) are left out."""
    out: list[list[SessionRecord]] = [[] for _ in step_ends]
    for r in records:
        if r.termination is TerminationReason.ABORTED:
            continue
        i = bisect.bisect_left(step_ends, r.started_at + r.duration_s)
        if i < len(out):
            out[i].append(r)
    return out


def step_histograms(values: list[list[float]], edges: np.ndarray) -> np.ndarray:
    """A `(len(edges) - 1, steps)` array: each step's share of values in each bin (columns sum to 1, or 0)."""
    grid = np.zeros((len(edges) - 1, len(values)))
    for j, vals in enumerate(values):
        if vals:
            counts, _ = np.histogram(np.clip(vals, edges[0], edges[-1]), bins=edges)
            grid[:, j] = counts / counts.sum()
    return grid


def reward_edges(rewards: list[float]) -> np.ndarray:
    """Bins for rewards: one per distinct value when there are few (e.g. 0, 0.5, 1), else 20 even bins."""
    distinct = sorted(set(rewards))
    if len(distinct) <= 12:
        mids = np.array(distinct, dtype=float)
        half = np.diff(mids).min() / 2 if len(mids) > 1 else 0.5
        return np.concatenate([[mids[0] - half], (mids[:-1] + mids[1:]) / 2, [mids[-1] + half]])
    return np.linspace(min(distinct), max(distinct), 21)


def latency_edges(latencies: list[float]) -> np.ndarray:
    """24 log-spaced bins over the observed latencies."""
    low = max(min(latencies), 1e-4)
    high = max(max(latencies), low * 1.01)
    return np.geomspace(low, high, 25)


def _heatmap(
    ax: Any, grid: np.ndarray, edges: np.ndarray, steps: list[int], *, log: bool, title: str, ylabel: str
) -> None:
    x = np.arange(len(steps) + 1) + 0.5
    mesh = ax.pcolormesh(x, edges, np.ma.masked_equal(grid, 0.0), cmap="viridis", shading="flat")
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("RL step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.figure.colorbar(mesh, ax=ax, label="share of the step")


def plot_run(metrics_path: str | Path, png_path: str | Path, sessions_path: str | Path | None = None) -> Path:
    """Draw the run's curves into `png_path`. The distributions come from `sessions_path` (by default the
    `sessions.jsonl` beside the metrics log) when it exists."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    sessions_path = Path(sessions_path) if sessions_path else Path(metrics_path).with_name("sessions.jsonl")
    per_step = (
        sessions_by_step(read_sessions(sessions_path).records, [r["time"] for r in train])
        if train and sessions_path.exists()
        else []
    )
    rewards = [[r.reward for r in step] for step in per_step]
    latencies = [[t.generate_s for r in step for t in r.turns if t.finish_reason] for step in per_step]
    has_dist = any(rewards)
    fig, axes = plt.subplots(2 if has_dist else 1, 2, figsize=(11, 7.6 if has_dist else 3.8), squeeze=False)
    ax1, ax2 = axes[0]
    steps = [r["step"] + 1 for r in train]
    ax1.plot(steps, [r["rollout_reward_mean"] for r in train], label="rollout reward")
    ax1.plot(steps, [r["rollout_success_rate"] for r in train], label="rollout success", alpha=0.7)
    ax1.set_xlabel("RL step")
    ax1.set_ylim(-0.05, 1.05)
    ax1.legend()
    ax1.set_title("rollouts")
    for mode in sorted({r["mode"] for r in evals}):
        pts = [(r["step"], r["success_rate"]) for r in evals if r["mode"] == mode]
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"held-out success ({mode})")
    ax2.set_xlabel("RL step")
    ax2.set_ylim(-0.05, 1.05)
    ax2.legend()
    ax2.set_title("evaluation")
    if has_dist:
        edges = reward_edges([x for step in rewards for x in step])
        _heatmap(
            axes[1][0],
            step_histograms(rewards, edges),
            edges,
            steps,
            log=False,
            title="reward distribution per step",
            ylabel="session reward",
        )
        if len(edges) <= 13:  # one bin per distinct reward: label the values themselves
            axes[1][0].set_yticks((edges[:-1] + edges[1:]) / 2)
        flat = [x for step in latencies for x in step]
        if flat:
            edges = latency_edges(flat)
            _heatmap(
                axes[1][1],
                step_histograms(latencies, edges),
                edges,
                steps,
                log=True,
                title="turn latency per step",
                ylabel="generate call (s)",
            )
        else:
            axes[1][1].set_axis_off()
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
