"""The committed Grafana dashboard is the generated one, and its queries read only declared families."""

from __future__ import annotations

import json
import re

import yaml

from miles.observability import FAMILIES
from miles.observability.dashboard import DASHBOARD_PATH, ROWS, VARIABLES, all_queries, build, main


def test_committed_dashboard_equals_the_generated_one():
    assert json.loads(DASHBOARD_PATH.read_text()) == build()
    assert main(["--check"]) == 0


def test_queries_read_declared_families_with_the_template_variables():
    samples = {s for f in FAMILIES for s in f.samples} | {
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
    }
    by_sample = {s: f for f in FAMILIES for s in f.samples}
    for expr in all_queries():
        names = re.findall(r"\b(?:miles|process)_\w+", expr)
        assert names and set(names) <= samples, expr
        for name in names:
            f = by_sample.get(name)
            if f is None:
                continue
            for label in ("run", "env", "model", "adapter"):  # every panel follows the variables it can
                assert (f'{label}=~"${label}"' in expr) == (label in f.labels), (expr, label)
    board = build()
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource", *(n for n, _ in VARIABLES)]
    assert all(f.source != "async" for f in FAMILIES if f.name in " ".join(all_queries()))  # unfed: no panel


def test_the_panels_the_issue_asks_for():
    titles = {p.title: p for _, panels in ROWS for p in panels}
    heatmaps = {t for t, p in titles.items() if p.kind == "heatmap"}
    assert {"Session latency", "Turn latency", "Reward distribution"} <= heatmaps
    for title in ("Rollout vs trainer KL", "Idle ratios", "Sync time", "GPU memory", "GPU fragmentation"):
        assert title in titles
    ids = [p["id"] for p in build()["panels"]]
    assert len(ids) == len(set(ids))


def test_scrape_config_scrapes_the_documented_port():
    scrape = yaml.safe_load((DASHBOARD_PATH.parents[1] / "prometheus.yml").read_text())
    (job,) = scrape["scrape_configs"]
    assert job["job_name"] == "miles"  # the process panel selects job="miles"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:9400"]
