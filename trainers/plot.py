"""The run's PNG plot: training reward and success per step, held-out success at each evaluation."""

from __future__ import annotations

from pathlib import Path

from miles.trainers.metrics_log import read_metrics


def plot_run(metrics_path: str | Path, png_path: str | Path) -> Path:
    """Draw the reward and success-rate curves of a metrics log into `png_path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
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
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
