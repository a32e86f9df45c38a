"""The metric-history gate (`history_gate.py`): today's code learns inside the corridors of trusted runs, and
the gate can fail: a non-finite value, a curve outside its corridor."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.history_gate import CORRIDORS, METRICS, STEPS, WINDOW, corridors_from, gate_run, violations


def _corridors() -> dict:
    return json.loads(CORRIDORS.read_text())["corridors"]


@pytest.mark.slow
def test_a_fixed_seed_run_stays_inside_the_trusted_corridors_and_a_3x_learning_rate_leaves_them(tmp_path):
    """The gate on today's code, and on a planted regression (the calculator example at 3x its learning rate),
    run side by side (one thread each)."""
    with ThreadPoolExecutor(2) as pool:
        healthy = pool.submit(gate_run, tmp_path / "run")
        regressed = pool.submit(gate_run, tmp_path / "lr3x", "trainer.lr=0.0009")
        rows, bad = healthy.result(), regressed.result()
    assert len(rows) == STEPS and violations(rows, _corridors()) == []
    assert any("outside its corridor" in v for v in violations(bad, _corridors()))


def _rows(value: float, **at: float) -> list[dict]:
    return [{"step": s, **dict.fromkeys(METRICS, value), **at} for s in range(1, STEPS + 1)]


def test_the_gate_fails_a_curve_outside_its_corridor_and_a_non_finite_value():
    trusted = [_rows(0.5), _rows(0.52), _rows(0.48)]
    corridors = corridors_from(trusted)
    assert set(corridors) == set(METRICS) and len(corridors["entropy"]) == STEPS - WINDOW + 1
    assert violations(_rows(0.5), corridors) == []
    drifted = _rows(0.5)
    for row in drifted[30:]:
        row["clip_frac"] = 0.9
    found = violations(drifted, corridors)
    assert (
        len(found) == 1
        and found[0].startswith("clip_frac: outside its corridor at ")
        and "step 31" in found[0]
    )
    poisoned = _rows(0.5)
    poisoned[5]["entropy"] = math.nan
    assert any(v == "step 6: entropy is nan" for v in violations(poisoned, corridors))
