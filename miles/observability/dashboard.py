"""The Grafana dashboard for a miles run, generated from code with Grafana's `grafana-foundation-sdk`.

    python -m miles.observability.dashboard          # rewrites observability/grafana/miles.json
    python -m miles.observability.dashboard --check  # exit 1 if the committed JSON is out of date

Every query selects on the template variables `run`, `env`, `model` and `adapter` (engine and GPU panels on
the ones their families carry) and reads only families declared in `miles.observability.families`.
`$__rate_interval` is Grafana's rate window for the scrape interval.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from miles.observability.families import family

DASHBOARD_PATH = Path(__file__).resolve().parents[2] / "observability" / "grafana" / "miles.json"
DS = "${datasource}"
RUN = 'run=~"$run",env=~"$env",model=~"$model",adapter=~"$adapter"'
POLICY = 'run=~"$run",model=~"$model",adapter=~"$adapter"'
ENGINE = 'run=~"$run",model=~"$model"'
GPU = 'run=~"$run"'
RATE = "[$__rate_interval]"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class PanelSpec:
    """One panel: `kind` is "heatmap" (a Prometheus histogram's buckets over time) or "timeseries"."""

    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = ""
    kind: str = "timeseries"
    stacked: bool = False


def _rate(name: str, sel: str, by: str = "") -> str:
    family(name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count"))  # a declared family
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({name}{{{sel}}}{RATE}))"


def _mean(name: str, sel: str, by: str = "") -> str:
    return f"{_rate(name + '_sum', sel, by)} / {_rate(name + '_count', sel, by)}"


def _quantile(q: float, name: str, sel: str) -> Query:
    return Query(f"histogram_quantile({q}, {_rate(name + '_bucket', sel, 'le')})", f"p{round(q * 100)}")


def _gauge(name: str, sel: str, extra: str = "") -> str:
    family(name)
    return f"{name}{{{sel}{extra}}}"


def _heatmap(title: str, description: str, name: str, sel: str, unit: str) -> PanelSpec:
    return PanelSpec(
        title, description, (Query(_rate(name + "_bucket", sel, "le"), "{{le}}"),), unit, "heatmap"
    )


ROWS: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    (
        "Rollouts",
        (
            _heatmap(
                "Session latency",
                "Wall time of each finished session, reset to end (a heatmap of "
                "miles_session_duration_seconds).",
                "miles_session_duration_seconds",
                RUN,
                "s",
            ),
            _heatmap(
                "Turn latency",
                "Latency of each successful generate call; slow engines show up as a second band.",
                "miles_turn_generate_seconds",
                RUN,
                "s",
            ),
            _heatmap(
                "Time to first token (embedded engines)",
                "From a request's arrival at the engine to its first "
                "token (the end of its prefill; the engines do not stream).",
                "miles_engine_time_to_first_token_seconds",
                ENGINE,
                "s",
            ),
            _heatmap(
                "Reward distribution",
                "How session rewards spread over time: a policy that learns moves mass to the top buckets.",
                "miles_session_reward",
                RUN,
                "none",
            ),
            PanelSpec(
                "Reward and success",
                "Mean session reward and success share of each step's rollouts.",
                (
                    Query(_gauge("miles_rollout_reward_mean", RUN), "mean reward"),
                    Query(_gauge("miles_rollout_success_ratio", RUN), "success"),
                ),
                "short",
            ),
            PanelSpec(
                "Sessions by termination",
                "Sessions ended per second, by reason: done and max_turns are the "
                "policy's doing; timeout, engine_error, env_error, context_full and aborted are not.",
                (Query(_rate("miles_sessions_total", RUN, "termination"), "{{termination}}"),),
                "ops",
                stacked=True,
            ),
            PanelSpec(
                "Session latency quantiles",
                "p50/p90/p99 of session wall time.",
                tuple(_quantile(q, "miles_session_duration_seconds", RUN) for q in (0.5, 0.9, 0.99)),
                "s",
            ),
            PanelSpec(
                "Turns and response length",
                "Median turns per session and tokens per turn.",
                (
                    Query(
                        f"histogram_quantile(0.5, {_rate('miles_session_turns_bucket', RUN, 'le')})",
                        "turns p50",
                    ),
                    Query(
                        f"histogram_quantile(0.5, {_rate('miles_turn_output_tokens_bucket', RUN, 'le')})",
                        "tokens per turn p50",
                    ),
                ),
                "short",
            ),
            PanelSpec(
                "Tool calls and errors",
                "Tool calls per second by tool, and failed calls by error kind.",
                (
                    Query(_rate("miles_tool_calls_total", RUN, "tool"), "{{tool}}"),
                    Query(_rate("miles_tool_errors_total", RUN, "kind"), "error: {{kind}}"),
                ),
                "ops",
            ),
            PanelSpec(
                "Retries and queueing",
                "Failed generate attempts per second by engine and reason, and the "
                "mean time turns waited for an engine slot.",
                (
                    Query(
                        _rate("miles_turn_retries_total", RUN, "engine, reason"),
                        "retry {{engine}} {{reason}}",
                    ),
                    Query(_mean("miles_turn_queue_seconds", RUN), "mean queue (s)"),
                ),
                "short",
            ),
        ),
    ),
    (
        "Engines",
        (
            PanelSpec(
                "Decode throughput",
                "Tokens decoded per second by each embedded engine.",
                (Query(_rate("miles_engine_decode_tokens_total", ENGINE, "engine"), "{{engine}}"),),
                "tps",
            ),
            PanelSpec(
                "Batch size and queue",
                "Mean rows per decode step, requests decoding and waiting.",
                (
                    Query(_mean("miles_engine_batch_size", ENGINE, "engine"), "mean batch {{engine}}"),
                    Query(_gauge("miles_engine_running_requests", ENGINE), "running {{engine}}"),
                    Query(_gauge("miles_engine_waiting_requests", ENGINE), "waiting {{engine}}"),
                ),
                "short",
            ),
            PanelSpec(
                "KV cache hit ratio",
                "Share of prompt tokens served from a cached prefix: per engine, and "
                "over every turn the scheduler sent.",
                (
                    Query(
                        f"{_rate('miles_engine_cached_tokens_total', ENGINE, 'engine')} / ("
                        f"{_rate('miles_engine_cached_tokens_total', ENGINE, 'engine')} + "
                        f"{_rate('miles_engine_prefill_tokens_total', ENGINE, 'engine')})",
                        "{{engine}}",
                    ),
                    Query(
                        f"{_rate('miles_turn_cached_tokens_total', RUN)} / "
                        f"{_rate('miles_turn_prompt_tokens_total', RUN)}",
                        "all turns",
                    ),
                ),
                "percentunit",
            ),
        ),
    ),
    (
        "Training",
        (
            PanelSpec(
                "Rollout vs trainer KL",
                "Token-level KL(rollout || trainer) on trained tokens (k3), mean and "
                "max, the PPO approximate KL, and the KL to the reference policy when one is kept.",
                (
                    Query(_gauge("miles_train_rollout_kl", RUN), "rollout/trainer {{stat}}"),
                    Query(_gauge("miles_policy_approx_kl", RUN), "PPO approx KL"),
                    Query(_gauge("miles_reference_kl", RUN), "reference KL"),
                ),
                "short",
            ),
            PanelSpec(
                "Importance-ratio tail",
                "Shares of trained tokens whose rollout/trainer ratio lies outside "
                "[0.9, 1.1] and [0.5, 2]: a mean mismatch hides them (off-policy drift, truncated sampling).",
                (Query(_gauge("miles_train_importance_ratio_tail", RUN, ',stat=~"outside.*"'), "{{stat}}"),),
                "percentunit",
            ),
            PanelSpec(
                "Entropy, clipping, gradient",
                "Mean token entropy, share of clipped tokens, gradient norm.",
                (
                    Query(_gauge("miles_policy_entropy", RUN), "entropy"),
                    Query(_gauge("miles_policy_clip_ratio", RUN), "clip ratio"),
                    Query(_gauge("miles_grad_norm", RUN), "grad norm"),
                ),
                "short",
            ),
            PanelSpec(
                "Step time split",
                "Seconds per second of wall time spent in each phase of an RL step.",
                (Query(_rate("miles_step_phase_seconds_sum", RUN + ',phase!="step"', "phase"), "{{phase}}"),),
                "percentunit",
                stacked=True,
            ),
            PanelSpec(
                "Idle ratios",
                "Share of a step the trainer waited for rollouts, and the engines had no rollout work.",
                (
                    Query(_gauge("miles_trainer_idle_ratio", RUN), "trainer idle"),
                    Query(_gauge("miles_rollout_idle_ratio", RUN), "rollout idle"),
                ),
                "percentunit",
            ),
            PanelSpec(
                "Throughput and MFU",
                "Tokens trained and generated per second of their phase, and the model "
                "FLOPs utilization of training where the device peak is known.",
                (
                    Query(_gauge("miles_train_tokens_per_second", RUN), "trained tok/s"),
                    Query(_gauge("miles_rollout_tokens_per_second", RUN), "generated tok/s"),
                    Query(f"100 * {_gauge('miles_mfu_ratio', RUN)}", "MFU %"),
                ),
                "short",
            ),
        ),
    ),
    (
        "Weight sync",
        (
            PanelSpec(
                "Sync time",
                "Mean seconds per weight sync, and the part spent draining in-flight requests.",
                (
                    Query(_mean("miles_weight_sync_seconds", POLICY, "method"), "sync {{method}}"),
                    Query(_mean("miles_weight_sync_drain_seconds", POLICY, "method"), "drain {{method}}"),
                ),
                "s",
            ),
            PanelSpec(
                "Sync bandwidth",
                "Bytes of weights pushed per second.",
                (Query(_rate("miles_weight_sync_bytes_total", POLICY, "method"), "{{method}}"),),
                "Bps",
            ),
            PanelSpec(
                "Weight versions",
                "The policy's latest synced version and the version each engine serves: "
                "a gap is an engine that missed a sync.",
                (
                    Query(_gauge("miles_weight_version", POLICY), "policy"),
                    Query(_gauge("miles_engine_weight_version", ENGINE), "{{engine}}"),
                ),
                "short",
            ),
        ),
    ),
    (
        "Memory and process",
        (
            PanelSpec(
                "GPU memory",
                "Bytes held by tensors, held by the caching allocator, and the peak.",
                (
                    Query(_gauge("miles_gpu_memory_allocated_bytes", GPU), "allocated {{device}}"),
                    Query(_gauge("miles_gpu_memory_reserved_bytes", GPU), "reserved {{device}}"),
                    Query(_gauge("miles_gpu_memory_peak_allocated_bytes", GPU), "peak {{device}}"),
                ),
                "bytes",
            ),
            PanelSpec(
                "GPU fragmentation",
                "Reserved-but-free bytes against the largest free block: when the block "
                "is much smaller, large tensors need new cudaMalloc calls (or fail) although memory is free.",
                (
                    Query(_gauge("miles_gpu_memory_fragmentation_bytes", GPU), "free reserved {{device}}"),
                    Query(
                        _gauge("miles_gpu_memory_largest_free_block_bytes", GPU),
                        "largest free block {{device}}",
                    ),
                ),
                "bytes",
            ),
            PanelSpec(
                "Process CPU and memory",
                "CPU cores used and resident memory of each scraped process.",
                (
                    Query('rate(process_cpu_seconds_total{job="miles"}' + RATE + ")", "CPU {{instance}}"),
                    Query('process_resident_memory_bytes{job="miles"} / 2^30', "RSS GiB {{instance}}"),
                ),
                "short",
            ),
        ),
    ),
)

VARIABLES = (
    ("run", "miles_sessions_total"),
    ("env", "miles_sessions_total"),
    ("model", "miles_sessions_total"),
    ("adapter", "miles_sessions_total"),
)


def all_queries() -> list[str]:
    """Every PromQL expression of the dashboard's panels."""
    return [q.expr for _, panels in ROWS for p in panels for q in p.queries]


def build() -> dict:
    """The dashboard as Grafana's JSON model."""
    from grafana_foundation_sdk.builders import dashboard, heatmap, prometheus, timeseries
    from grafana_foundation_sdk.builders.common import StackingConfig
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.common import StackingMode
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh, VariableSort
    from grafana_foundation_sdk.models.prometheus import PromQueryFormat

    ds = DataSourceRef(type_val="prometheus", uid=DS)
    board = (
        dashboard.Dashboard("miles")
        .uid("miles-run")
        .tags(["miles", "rl"])
        .refresh("10s")
        .time("now-1h", "now")
        .editable()
        .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
    )
    for name, metric in VARIABLES:
        board = board.with_variable(
            dashboard.QueryVariable(name)
            .label(name)
            .datasource(ds)
            .query(f"label_values({metric}, {name})")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .include_all(True)
            .all_value(".*")
            .multi(True)
        )
    ids = iter(range(1, 1000))
    for row_title, panels in ROWS:
        board = board.with_row(dashboard.Row(row_title).id(next(ids)))
        for spec in panels:
            panel = heatmap.Panel().calculate(False) if spec.kind == "heatmap" else timeseries.Panel()
            panel = (
                panel.id(next(ids))
                .title(spec.title)
                .description(spec.description)
                .datasource(ds)
                .height(8)
                .span(8)
            )
            if spec.unit:
                panel = panel.unit(spec.unit)
            if spec.stacked:
                panel = panel.stacking(StackingConfig().mode(StackingMode.NORMAL))
            for i, q in enumerate(spec.queries):
                target = prometheus.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i))
                if spec.kind == "heatmap":
                    target = target.format(PromQueryFormat.HEATMAP)
                panel = panel.with_target(target)
            board = board.with_panel(panel)
    import json

    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(board.build()))


def render() -> str:
    """The committed file's text."""
    import json

    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed dashboard is out of date")
    ap.add_argument("--out", type=Path, default=DASHBOARD_PATH)
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        print(
            f"{args.out}: {'up to date' if same else 'out of date: run python -m miles.observability.dashboard'}"
        )
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
