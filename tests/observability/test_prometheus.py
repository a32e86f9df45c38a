"""A real Prometheus server (Debian's `prometheus`) scrapes a short `miles train` through the shipped scrape
config; then every exported family must have arrived with its declared labels, and every PromQL expression
of the shipped dashboard must parse and return data over the run."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from miles.observability import FAMILIES
from miles.observability.dashboard import DASHBOARD_PATH, VARIABLES, all_queries, build
from miles.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRAPE_S = 0.5
# Families this run cannot feed, and why.
NOT_FED = {f.name: "fed by the async loop" for f in FAMILIES if f.source == "async"}
NOT_FED["miles_tool_duration_seconds"] = (
    "Calculator-v0 does not report tool durations in info['tool_results']"
)
GPU = {f.name for f in FAMILIES if f.source == "gpu"}

# Enough steps that every session-level counter rises across several scrapes even when a loaded CI box runs the
# steps fast and scrapes late (a rate() needs two scrapes of a rising series inside its window).
STEPS = 24
RUN_YAML = """
seed: 0
env:
  id: Calculator-v0
  kwargs: {max_operand: 9, num_operators: [1, 1], operators: "+-*", held_out_fraction: 0.5}
  num_train_tasks: 64
model: {name: tiny, size: 1m, chat_template: compact, init_from: checkpoints/calculator-sft-1m}
rollout:
  tasks_per_step: 2
  scheduler: {group_size: 4, progress: false, session: {sampling: {temperature: 1.0, max_new_tokens: 40}}}
algorithm: {loss: {kl_coef: 0.01}}  # keeps a reference policy, so the reference-KL query has data
trainer: {lr: 0.0003}
eval: {num_tasks: 2}
observability: {peak_tflops: 1.0}  # a known peak, so the MFU gauge is exported on CPU too
"""


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(
                "the prometheus binary is missing: CI installs it (`apt-get install -y prometheus` in .ci/run)"
            )
        pytest.skip("the prometheus binary is missing (apt-get install -y prometheus)")
    return found


def cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


def grafana_render(expr: str, step_s: float) -> str:
    """`expr` as Grafana sends it: template variables at their "All" value (.*), `$__rate_interval` at
    max(4 x scrape interval, step + scrape interval)."""
    rate_ms = int(1000 * max(4 * SCRAPE_S, step_s + SCRAPE_S))
    out = expr.replace("$__rate_interval", f"{rate_ms}ms")
    for name, _ in VARIABLES:
        out = out.replace(f"${name}", ".*")
    assert "$" not in out, out
    return out


LINGER_S = 3.0  # several scrapes of the final values (`observability.metrics_linger_s`)


@pytest.fixture(scope="module")
def scraped_run(tmp_path_factory):
    """(Prometheus API URL, start, end, run name, the `/metrics` text read while the run lingered) after a
    `miles train` that Prometheus scraped."""
    binary = prometheus_binary()
    tmp = tmp_path_factory.mktemp("prometheus")
    metrics_port, prom_port = free_port(), free_port()
    scrape = yaml.safe_load((ROOT / "observability" / "prometheus.yml").read_text())
    scrape["global"]["scrape_interval"] = scrape["global"]["evaluation_interval"] = (
        f"{int(SCRAPE_S * 1000)}ms"
    )
    (job,) = scrape["scrape_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(scrape))
    log = (tmp / "prometheus.log").open("w")
    prom = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    api = f"http://127.0.0.1:{prom_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{api}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert prom.poll() is None, (tmp / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)
        out = tmp / "run"
        (tmp / "run.yaml").write_text(RUN_YAML)
        start = time.time()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "miles.cli",
                "train",
                "--config",
                str(tmp / "run.yaml"),
                "--output-dir",
                str(out),
                "--set",
                f"steps={STEPS}",
                "--set",
                f"observability.metrics_port={metrics_port}",
                "--set",
                f"observability.metrics_linger_s={LINGER_S}",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        stdout, final = [], None
        for line in proc.stdout:  # read /metrics while the finished run lingers
            stdout.append(line)
            if line.startswith("[metrics] serving the final values"):
                final = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text
        assert proc.wait(600) == 0, "".join(stdout)[-2000:] + (tmp / "prometheus.log").read_text()[-3000:]
        end = time.time()
        assert f"[metrics] serving http://127.0.0.1:{metrics_port}/metrics" in "".join(stdout)
        assert final is not None, "".join(stdout)[-2000:]
        yield api, start, end, out.name, final
    finally:
        prom.terminate()
        prom.wait(10)
        log.close()


def api_get(api: str, path: str, **params) -> dict:
    body = httpx.get(f"{api}/api/v1/{path}", params=params, timeout=30).json()
    assert body["status"] == "success", body
    return body["data"]


@pytest.mark.slow
def test_every_family_arrived_with_its_labels(scraped_run):
    api, start, end, run, _ = scraped_run
    expected = {"run": run, "env": "Calculator-v0", "model": "tiny", "adapter": "base"}
    missing = []
    for f in FAMILIES:
        if f.name in NOT_FED or (f.name in GPU and not cuda_present()):
            continue
        series = api_get(api, "series", **{"match[]": f.samples[-1], "start": start, "end": end})
        if not series:
            missing.append(f.name)
            continue
        for s in series:
            assert set(s) - {"__name__", "job", "instance", "le"} == set(f.labels), (f.name, s)
            for key, value in expected.items():
                if key in f.labels:
                    assert s[key] == value, (f.name, s)
    assert not missing, f"families Prometheus never received: {missing}"
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes"):
        assert api_get(api, "series", **{"match[]": f'{name}{{job="miles"}}', "start": start, "end": end}), (
            name
        )


@pytest.mark.slow
def test_every_dashboard_query_parses_and_returns_data(scraped_run):
    api, start, end, run, _ = scraped_run
    assert build() == json.loads(DASHBOARD_PATH.read_text())  # the shipped file is what is tested
    step = 1.0
    empty = []
    for expr in all_queries():
        data = api_get(api, "query_range", query=grafana_render(expr, step), start=start, end=end, step=step)
        values = [float(v) for series in data["result"] for _, v in series["values"]]
        if "miles_gpu_" in expr and not cuda_present():
            assert data["result"] == [], expr  # parsed; nothing to show without CUDA
            continue
        if not any(math.isfinite(v) for v in values):
            empty.append(expr)
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
    for name, metric in VARIABLES:  # the template variables' label_values(...) queries
        values = api_get(api, f"label/{name}/values", **{"match[]": metric, "start": start, "end": end})
        assert values and (name != "run" or run in values), (name, values)


@pytest.mark.slow
def test_the_final_values_stay_up_after_the_run(scraped_run):
    """`metrics_linger_s`: after the last step and the final evaluation, `/metrics` still answers, with them."""
    api, start, end, run, final = scraped_run
    steps = [line for line in final.splitlines() if line.startswith("miles_steps_total{")]
    assert len(steps) == 1 and f'run="{run}"' in steps[0] and float(steps[0].split()[-1]) == STEPS, steps
    got = api_get(api, "query", query=f'max_over_time(miles_steps_total{{run="{run}"}}[1h])', time=end)
    assert [float(r["value"][1]) for r in got["result"]] == [STEPS]  # Prometheus scraped the last step too
