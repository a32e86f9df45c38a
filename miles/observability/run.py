"""What the train loop reports: one call per step (`observe_step`), one per sync (`observe_sync`).

`start_observability` sets a run up: its labels, the engines and GPU collectors, and the `/metrics` server
when `observability.metrics_port` is set. Session metrics come from `miles.sessions.metrics.SessionMetrics`,
the scheduler's observer, with the same labels.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.observability.config import ObservabilityConfig
from miles.observability.gpu import GpuCollector
from miles.observability.registry import Metrics, RunLabels, process_metrics
from miles.observability.server import MetricsServer, serve_metrics

if TYPE_CHECKING:
    from miles.weight_sync import SyncReport

#: Dense bf16 peaks in TFLOP/s by a substring of the CUDA device name (first match wins).
DEVICE_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
)

#: Trainer metric key -> (family, extra label values). Both backends report these names
#: (`miles.learner.losses.policy_loss`, `miles.learner.metrics.train_step_metrics`).
TRAIN_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "mismatch_kl": ("miles_train_rollout_kl", ("mean",)),
    "mismatch_kl_max": ("miles_train_rollout_kl", ("max",)),
    "mismatch_abs": ("miles_train_rollout_logprob_abs_diff", ()),
    "ratio_outside_10pct": ("miles_train_importance_ratio_tail", ("outside_0.9_1.1",)),
    "ratio_outside_2x": ("miles_train_importance_ratio_tail", ("outside_0.5_2",)),
    "log_ratio_abs_max": ("miles_train_importance_ratio_tail", ("log_ratio_abs_max",)),
    "approx_kl": ("miles_policy_approx_kl", ()),
    "entropy": ("miles_policy_entropy", ()),
    "clip_frac": ("miles_policy_clip_ratio", ()),
    "grad_norm": ("miles_grad_norm", ()),
    "loss": ("miles_train_loss", ()),
    "lr": ("miles_learning_rate", ()),
    "ref_kl": ("miles_reference_kl", ()),
}

#: Step row key -> phase label of `miles_step_phase_seconds`.
STEP_PHASES = {"rollout_s": "rollout", "train_s": "train", "sync_s": "sync", "step_s": "step"}


def device_peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of a CUDA device by its name, None when unknown."""
    for key, tflops in DEVICE_PEAK_TFLOPS:
        if key in device_name:
            return tflops * 1e12
    return None


def cuda_peak_flops() -> float | None:
    """`device_peak_flops` of CUDA device 0, None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    return device_peak_flops(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


class RunMetrics:
    """The step, trainer and sync metrics of one run, labelled with `labels`.

    `flops_per_token` (6 x parameters for a dense decoder) and `peak_flops` give the MFU gauge; without
    either it is not exported.
    """

    def __init__(
        self,
        labels: RunLabels,
        *,
        metrics: Metrics | None = None,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
    ) -> None:
        self.labels = labels
        self.metrics = metrics or process_metrics()
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._values = labels.values()

    def _child(self, name: str, *extra: str) -> Any:
        return self.metrics.child(name, *self._values, *extra)

    def observe_step(self, row: Mapping[str, Any]) -> None:
        """One RL step's metrics row (as `miles.training.rl_step.step_row` builds it, trainer metrics included): phase
        times, idle ratios, tokens/s, MFU, mean reward and success, the zero-spread group share, then
        `observe_train(row)`.

        Idle ratios: the row's `trainer_idle_ratio` / `rollout_idle_ratio` when it has them (the async loop);
        otherwise those of a synchronous step, where the trainer waits during the rollout and the engines
        idle for the rest of the step. Hooks for the async loop: `stale_groups_dropped` and `late_groups`
        (counts for this step) and `buffer_groups` (the buffer depth).
        """
        v = {k: x for k, x in ((k, _number(x)) for k, x in row.items()) if x is not None}
        self._child("miles_steps_total").inc()
        for key, phase in STEP_PHASES.items():
            if key in v:
                self._child("miles_step_phase_seconds", phase).observe(v[key])
        step_s, rollout_s, train_s = v.get("step_s", 0.0), v.get("rollout_s", 0.0), v.get("train_s", 0.0)
        trainer_idle = v.get("trainer_idle_ratio", rollout_s / step_s if step_s > 0 else None)
        rollout_idle = v.get("rollout_idle_ratio", 1.0 - rollout_s / step_s if step_s > 0 else None)
        if trainer_idle is not None:
            self._child("miles_trainer_idle_ratio").set(trainer_idle)
        if rollout_idle is not None:
            self._child("miles_rollout_idle_ratio").set(rollout_idle)
        tokens = v.get("num_tokens", 0.0)
        if tokens:
            self._child("miles_train_tokens_total").inc(tokens)
        if tokens and train_s > 0:
            self._child("miles_train_tokens_per_second").set(tokens / train_s)
            if self.flops_per_token and self.peak_flops:
                self._child("miles_mfu_ratio").set(self.flops_per_token * tokens / train_s / self.peak_flops)
        if rollout_s > 0 and "generated_tokens" in v:
            self._child("miles_rollout_tokens_per_second").set(v["generated_tokens"] / rollout_s)
        for key, name in (
            ("rollout_reward_mean", "miles_rollout_reward_mean"),
            ("rollout_success_rate", "miles_rollout_success_ratio"),
        ):
            if key in v:
                self._child(name).set(v[key])
        if "rollout_zero_std_group_frac" in v:
            self._child("miles_rollout_zero_std_group_ratio").set(v["rollout_zero_std_group_frac"])
        if v.get("stale_groups_dropped"):
            self._child("miles_stale_groups_dropped_total").inc(v["stale_groups_dropped"])
        if v.get("late_groups"):
            self._child("miles_late_groups_total").inc(v["late_groups"])
        if "buffer_groups" in v:
            self._child("miles_rollout_buffer_groups").set(v["buffer_groups"])
        self.observe_train(row)

    def observe_train(self, metrics: Mapping[str, Any]) -> None:
        """The trainer's metrics of one step (`TRAIN_GAUGES`): rollout-vs-trainer KL mean and max, PPO KL,
        entropy, clip fraction, grad norm, loss, lr, reference KL. Only gauges: calling it twice is harmless."""
        for key, (name, extra) in TRAIN_GAUGES.items():
            value = _number(metrics.get(key))
            if value is not None:
                self._child(name, *extra).set(value)

    def observe_sync(self, report: SyncReport) -> None:
        """One weight sync: its time, drain time, bytes and the version it published."""
        policy = self.labels.policy()
        self.metrics.child("miles_weight_sync_seconds", *policy, report.method).observe(report.seconds)
        self.metrics.child("miles_weight_sync_drain_seconds", *policy, report.method).observe(
            report.drain_seconds
        )
        self.metrics.child("miles_weight_sync_bytes_total", *policy, report.method).inc(report.num_bytes)
        self.metrics.child("miles_weight_version", *policy).set(report.version)

    def observe_staleness(self, staleness: Iterable[int]) -> None:
        """Hook for the async loop: each trained sample's staleness (trainer version minus its oldest token
        version)."""
        hist = self._child("miles_sample_staleness")
        for s in staleness:
            hist.observe(s)


def run_labels(
    config: ObservabilityConfig,
    output_dir: str | os.PathLike[str],
    env: str,
    model: str,
    adapter: str = "base",
) -> RunLabels:
    """A run's labels: `run` is `config.run_name` or the output folder's name; a model given as a folder is
    labelled by the folder's name."""
    return RunLabels(
        run=config.run_name or Path(output_dir).resolve().name,
        env=env,
        model=Path(model).name,
        adapter=adapter,
    )


@dataclass
class Observability:
    """A run's observability: `run` (step/train/sync metrics), its `labels` (for the session observer) and the
    `/metrics` server when one was asked for. `linger()` keeps the server up `linger_s` more seconds at the
    run's end; `close()` stops it."""

    labels: RunLabels
    run: RunMetrics
    server: MetricsServer | None = None
    linger_s: float = 0.0

    async def linger(self, echo: Callable[[str], None] = print) -> float:
        """Serve the final values `linger_s` seconds more, for a last scrape (when `/metrics` is served); returns
        the seconds it waited."""
        if self.server is None or self.linger_s <= 0:
            return 0.0
        echo(f"[metrics] serving the final values {self.linger_s:g} s more at {self.server.url}")
        sys.stdout.flush()  # whoever watches the log for this line sees it now, not at exit
        await asyncio.sleep(self.linger_s)
        return self.linger_s

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


def start_observability(
    config: ObservabilityConfig,
    labels: RunLabels,
    *,
    engines: Sequence[Any] = (),
    num_params: int | None = None,
    metrics: Metrics | None = None,
    echo: Callable[[str], None] = print,
) -> Observability:
    """Set a run up: track its embedded `engines`, export GPU memory, and serve `/metrics` when
    `config.metrics_port` is set (announced through `echo`). `num_params` (the policy's parameter count)
    enables the MFU gauge where the device's peak is known (or `config.peak_tflops` is set)."""
    from miles.engines.embedded import EmbeddedEngine
    from miles.engines.metrics import engine_collector

    metrics = metrics or process_metrics()
    collector = engine_collector(metrics)
    for engine in engines:
        if isinstance(engine, EmbeddedEngine):  # HTTP engines serve their own /metrics
            collector.track(engine, run=labels.run, model=labels.model)
    metrics.collector(f"gpu:{labels.run}", lambda: GpuCollector(labels.run))
    peak = config.peak_tflops * 1e12 if config.peak_tflops else cuda_peak_flops()
    run = RunMetrics(
        labels, metrics=metrics, flops_per_token=6.0 * num_params if num_params else None, peak_flops=peak
    )
    server = None
    if config.metrics_port is not None:
        server = serve_metrics(metrics, config.metrics_host, config.metrics_port)
        echo(f"[metrics] serving {server.url}")
    return Observability(labels=labels, run=run, server=server, linger_s=config.metrics_linger_s)
