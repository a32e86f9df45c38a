"""`start_run`: where a run's steps start. A fresh run warm-starts its `PolicyRun`; a resumed one continues
from its newest checkpoint, and forgets the metric rows and held-out sessions written after it (it redoes
them)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from miles.training.assembly import RunParts
from miles.training.evaluate import EvalResult, recorded_evals
from miles.training.metrics_log import MetricsLog
from miles.training.wall import Budget


async def start_run(
    parts: RunParts,
    out: Path,
    metrics: MetricsLog,
    *,
    resume: bool,
    budget: Budget,
    limited: bool,
    echo: Callable[[str], None],
) -> tuple[int, float | None, dict[str, EvalResult]]:
    """Resume the run in `out` from its newest checkpoint, or warm-start a fresh one. Returns the step to start
    at, for a resumed run the time after which recorded work is redone (else None), and the held-out results
    recorded at the run's start (empty for a fresh run). `limited`: the budget carries over from the earlier
    part of the run."""
    root = out / "checkpoints"
    if not resume:
        await parts.policy.warm_start(budget.left())
        return 0, None, {}
    if not any(root.glob("step_*")):  # killed before its first checkpoint: every step is redone
        _set_aside_after(parts, metrics, 0.0)
        await parts.policy.restore(None, saved_at=0.0)
        echo(
            f"[resume] no checkpoint in {root}: starting at step 0 (the earlier sessions are moved to "
            "sessions.jsonl.dropped)"
        )
        await parts.policy.warm_start(budget.left())
        return 0, 0.0, {}
    ckpt = parts.trainer.load_checkpoint(root)
    for reason in ckpt.passed_over:
        echo(f"[resume] passed over a damaged checkpoint: {reason}")
    saved_at = float(ckpt.extra.get("time", float("inf")))
    _set_aside_after(parts, metrics, saved_at)
    await parts.policy.restore(ckpt, saved_at=saved_at)
    spent = f"; {budget.spent():.0f} s of max_seconds ({budget.limit:.0f} s) spent" if limited else ""
    echo(f"[resume] from {ckpt.path.name}: step {ckpt.step}{spent}")
    return ckpt.step, saved_at, recorded_evals(out / "metrics.jsonl", "start")


def _set_aside_after(parts: RunParts, metrics: MetricsLog, saved_at: float) -> None:
    """Forget the metric rows and held-out sessions written after `saved_at`: a resumed run redoes them."""
    metrics.drop_after(saved_at)
    parts.eval_recorder.drop_after(saved_at)
