"""`miles top URL`: a live terminal view of a `/metrics` endpoint (a `miles train` run or an engine server).

Each frame scrapes the endpoint and parses it with prometheus-client's parser; rates and the windowed
latency quantiles come from the difference with the previous scrape (the first frame, and `--once`, show
totals since the process started).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.table import Table

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Snapshot:
    """One scrape: every sample's value by name and label set, and when it was taken."""

    at: float
    samples: dict[str, dict[Labels, float]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str, at: float) -> Snapshot:
        samples: dict[str, dict[Labels, float]] = defaultdict(dict)
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                samples[s.name][tuple(sorted(s.labels.items()))] = s.value
        return cls(at, dict(samples))

    def total(self, name: str, **match: str) -> float | None:
        """The sum of `name` over the label sets that include `match` (None when there is none)."""
        found = [v for labels, v in self.samples.get(name, {}).items() if _matches(labels, match)]
        return sum(found) if found else None

    def values(self, label: str, name: str) -> list[str]:
        """The values `label` takes among the samples of `name`, sorted."""
        return sorted({dict(labels)[label] for labels in self.samples.get(name, {}) if label in dict(labels)})

    def buckets(self, name: str, **match: str) -> list[tuple[float, float]]:
        """The cumulative buckets of histogram `name` summed over matching label sets, as `(le, count)`."""
        out: dict[float, float] = defaultdict(float)
        for labels, v in self.samples.get(f"{name}_bucket", {}).items():
            if _matches(labels, match):
                out[float(dict(labels)["le"])] += v
        return sorted(out.items())


def _matches(labels: Labels, match: dict[str, str]) -> bool:
    d = dict(labels)
    return all(d.get(k) == v for k, v in match.items())


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' `histogram_quantile` on cumulative `(le, count)` buckets (linear inside a bucket; the
    +Inf bucket answers the highest finite bound). None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower_le
            if count == lower_count:
                return le
            return lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
        lower_le, lower_count = le, count
    return buckets[-1][0]


def _delta_buckets(
    cur: list[tuple[float, float]], prev: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    before = dict(prev)
    return [(le, c - before.get(le, 0.0)) for le, c in cur]


class Frame:
    """What one frame shows, from the current scrape and (for rates) the previous one."""

    def __init__(self, cur: Snapshot, prev: Snapshot | None) -> None:
        self.cur, self.prev = cur, prev
        self.dt = cur.at - prev.at if prev is not None and cur.at > prev.at else None

    def rate(self, name: str, **match: str) -> float | None:
        now = self.cur.total(name, **match)
        if now is None or self.dt is None or self.prev is None:
            return None
        return (now - (self.prev.total(name, **match) or 0.0)) / self.dt

    def window(self, name: str, **match: str) -> list[tuple[float, float]]:
        """Histogram buckets since the previous scrape when they moved, else since the process started."""
        cur = self.cur.buckets(name, **match)
        if self.prev is not None:
            moved = _delta_buckets(cur, self.prev.buckets(name, **match))
            if moved and moved[-1][1] > 0:
                return moved
        return cur

    def mean(self, name: str, **match: str) -> float | None:
        total, count = self.cur.total(f"{name}_sum", **match), self.cur.total(f"{name}_count", **match)
        return total / count if total is not None and count else None


def _f(value: float | None, unit: str = "", digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if abs(value) < 1 else f"{value:.2f} s"
    if unit == "B":
        for suffix, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if abs(value) >= scale:
                return f"{value / scale:.1f} {suffix}"
        return f"{value:.0f} B"
    if unit == "%":
        return f"{100 * value:.1f}%"
    return f"{value:.{digits}g}{unit}"


def _bar(buckets: list[tuple[float, float]], width: int = 24) -> str:
    """The distribution over buckets as a row of block characters (one per finite bucket)."""
    counts, last = [], 0.0
    for _, c in buckets:
        counts.append(max(0.0, c - last))
        last = c
    top = max(counts, default=0.0)
    blocks = " ▁▂▃▄▅▆▇█"
    return "".join(blocks[round(8 * c / top)] if top else " " for c in counts[:width])


def _table(title: str, columns: Iterable[str]) -> Table:
    table = Table(title=title, title_justify="left", expand=False, pad_edge=False)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right")
    return table


def render(cur: Snapshot, prev: Snapshot | None = None, url: str = "") -> Group:
    """One frame of `miles top`."""
    fr = Frame(cur, prev)
    parts: list = [
        f"[bold]miles top[/bold] {url}  "
        + time.strftime("%H:%M:%S", time.localtime(cur.at))
        + ("" if fr.dt else "  (totals since start; rates need a second scrape)")
    ]
    if cur.total("miles_sessions_total") is not None:
        t = _table("Sessions", ("", "value"))
        ends = ", ".join(
            f"{r} {cur.total('miles_sessions_total', termination=r):.0f}"
            for r in cur.values("termination", "miles_sessions_total")
            if cur.total("miles_sessions_total", termination=r)
        )
        t.add_row("ended", f"{cur.total('miles_sessions_total'):.0f} ({ends or 'none'})")
        t.add_row("sessions/s", _f(fr.rate("miles_sessions_total")))
        lat = fr.window("miles_session_duration_seconds")
        t.add_row(
            "session latency p50 / p90 / p99",
            " / ".join(_f(histogram_quantile(q, lat), "s") for q in (0.5, 0.9, 0.99)),
        )
        turn = fr.window("miles_turn_generate_seconds")
        t.add_row(
            "turn latency p50 / p90", " / ".join(_f(histogram_quantile(q, turn), "s") for q in (0.5, 0.9))
        )
        reward = fr.window("miles_session_reward")
        t.add_row(
            "reward p10 / p50 / p90", " / ".join(_f(histogram_quantile(q, reward)) for q in (0.1, 0.5, 0.9))
        )
        t.add_row(
            "reward histogram",
            f"{reward[0][0]:g} [{_bar(reward)}] {reward[-2][0]:g}" if len(reward) > 1 else "-",
        )
        t.add_row(
            "last step: reward mean / success",
            f"{_f(cur.total('miles_rollout_reward_mean'))} / "
            f"{_f(cur.total('miles_rollout_success_ratio'), '%')}",
        )
        t.add_row("turns / session", _f(fr.mean("miles_session_turns")))
        t.add_row("tokens / turn", _f(fr.mean("miles_turn_output_tokens")))
        t.add_row(
            "tool calls / errors",
            f"{_f(cur.total('miles_tool_calls_total'))} / {_f(cur.total('miles_tool_errors_total'))}",
        )
        t.add_row("retries", _f(cur.total("miles_turn_retries_total")))
        parts.append(t)
    engines = cur.values("engine", "miles_engine_decode_tokens_total")
    if engines:
        t = _table(
            "Engines",
            ("engine", "decode tok/s", "batch", "running", "waiting", "KV hit", "TTFT p50", "version"),
        )
        for e in engines:
            cached = cur.total("miles_engine_cached_tokens_total", engine=e) or 0.0
            prefill = cur.total("miles_engine_prefill_tokens_total", engine=e) or 0.0
            ttft = fr.window("miles_engine_time_to_first_token_seconds", engine=e)
            t.add_row(
                e,
                _f(fr.rate("miles_engine_decode_tokens_total", engine=e), digits=4),
                _f(fr.mean("miles_engine_batch_size", engine=e)),
                _f(cur.total("miles_engine_running_requests", engine=e)),
                _f(cur.total("miles_engine_waiting_requests", engine=e)),
                _f(cached / (cached + prefill) if cached + prefill else None, "%"),
                _f(histogram_quantile(0.5, ttft), "s"),
                _f(cur.total("miles_engine_weight_version", engine=e)),
            )
        parts.append(t)
    if cur.total("miles_steps_total") is not None:
        t = _table("Training", ("", "value"))
        t.add_row("steps", _f(cur.total("miles_steps_total"), digits=6))
        t.add_row("step time (mean)", _f(fr.mean("miles_step_phase_seconds", phase="step"), "s"))
        t.add_row(
            "rollout / train / sync (mean)",
            " / ".join(
                _f(fr.mean("miles_step_phase_seconds", phase=p), "s") for p in ("rollout", "train", "sync")
            ),
        )
        t.add_row(
            "trainer idle / rollout idle",
            f"{_f(cur.total('miles_trainer_idle_ratio'), '%')} / "
            f"{_f(cur.total('miles_rollout_idle_ratio'), '%')}",
        )
        t.add_row(
            "rollout-trainer KL mean / max",
            f"{_f(cur.total('miles_train_rollout_kl', stat='mean'))} / "
            f"{_f(cur.total('miles_train_rollout_kl', stat='max'))}",
        )
        for label, name in (
            ("entropy", "miles_policy_entropy"),
            ("clip ratio", "miles_policy_clip_ratio"),
            ("grad norm", "miles_grad_norm"),
            ("trained tok/s", "miles_train_tokens_per_second"),
        ):
            t.add_row(label, _f(cur.total(name), digits=4))
        t.add_row("MFU", _f(cur.total("miles_mfu_ratio"), "%"))
        parts.append(t)
    if cur.total("miles_weight_sync_seconds_count") is not None:
        t = _table("Weight sync", ("", "value"))
        t.add_row("syncs", _f(cur.total("miles_weight_sync_seconds_count"), digits=6))
        t.add_row("mean time", _f(fr.mean("miles_weight_sync_seconds"), "s"))
        t.add_row("bytes pushed", _f(cur.total("miles_weight_sync_bytes_total"), "B"))
        t.add_row("policy version", _f(cur.total("miles_weight_version"), digits=9))
        parts.append(t)
    devices = cur.values("device", "miles_gpu_memory_allocated_bytes")
    if devices:
        t = _table(
            "GPU memory",
            ("device", "allocated", "reserved", "peak", "free reserved", "largest free", "fragmentation"),
        )
        for d in devices:
            g = {
                n: cur.total(f"miles_gpu_memory_{n}", device=d)
                for n in (
                    "allocated_bytes",
                    "reserved_bytes",
                    "peak_allocated_bytes",
                    "fragmentation_bytes",
                    "largest_free_block_bytes",
                    "fragmentation_ratio",
                )
            }
            t.add_row(
                d,
                *(
                    _f(g[n], "B")
                    for n in (
                        "allocated_bytes",
                        "reserved_bytes",
                        "peak_allocated_bytes",
                        "fragmentation_bytes",
                        "largest_free_block_bytes",
                    )
                ),
                _f(g["fragmentation_ratio"], "%"),
            )
        parts.append(t)
    if cur.total("process_resident_memory_bytes") is not None:
        t = _table("Process", ("", "value"))
        t.add_row("CPU", _f(fr.rate("process_cpu_seconds_total"), " cores"))
        t.add_row("resident memory", _f(cur.total("process_resident_memory_bytes"), "B"))
        parts.append(t)
    return Group(*parts)


def scrape(url: str, client: httpx.Client) -> Snapshot:
    """Fetch and parse `url` (a `/metrics` endpoint)."""
    response = client.get(url, timeout=10)
    response.raise_for_status()
    return Snapshot.parse(response.text, time.time())


def metrics_url(target: str) -> str:
    """`host:port`, `http://host:port` or a full `/metrics` URL, as the URL to scrape."""
    url = target if "://" in target else f"http://{target}"
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


def run_top(
    target: str,
    *,
    once: bool = False,
    interval: float = 2.0,
    console: Console | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Show `target`'s metrics: one frame with `once`, else a live view until Ctrl-C. Returns the exit status
    (2 when the endpoint cannot be read)."""
    from rich.live import Live

    console = console or Console()
    url = metrics_url(target)
    with httpx.Client() as client:
        try:
            prev = scrape(url, client)
        except (httpx.HTTPError, ValueError) as exc:
            console.print(f"miles top: cannot read {url}: {exc}")
            return 2
        if once:
            console.print(render(prev, None, url))
            return 0
        try:
            frame = render(prev, None, url)
            with Live(frame, console=console, refresh_per_second=4) as live:
                while True:
                    sleep(interval)
                    try:
                        cur = scrape(url, client)
                    except httpx.HTTPError as exc:
                        live.update(
                            Group(frame, f"[red]{url} stopped answering ({exc}); showing the last frame")
                        )
                        continue
                    frame = render(cur, prev, url)
                    live.update(frame)
                    prev = cur
        except KeyboardInterrupt:
            return 0
