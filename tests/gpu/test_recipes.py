"""The real-model recipes on one GPU: where their figures in docs/benchmarks.md come from.

Skipped without CUDA (CI has none). Each recipe runs through `miles train` as a user runs it, per seed, and
the test checks what the docs claim: the calculator recipe gains at least 20 points of held-out success over
its SFT start within its 5-minute budget; the BFCL recipe reports BFCL's held-out accuracy per category before
and after RL (measured, whatever it is). With `MILES_GPU_OUT` set, each run's summary and metrics are copied
there.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from miles.cli import main

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU recipes need a CUDA device"),
]
REPO = Path(__file__).resolve().parents[2]


def _run(config: str, seed: int, out: Path) -> dict:
    assert (
        main(
            [
                "train",
                "--config",
                str(REPO / "configs" / config),
                "--seed",
                str(seed),
                "--output-dir",
                str(out),
            ]
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    keep = os.environ.get("MILES_GPU_OUT")
    if keep:
        for name in ("summary.json", "metrics.jsonl", "curves.png"):
            shutil.copy(out / name, Path(keep) / f"{out.name}-{name}")
    return summary


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_smollm2_calculator_recipe_gains_20_points_over_its_sft_start(seed, tmp_path):
    summary = _run("smollm2_calculator.yaml", seed, tmp_path / f"smollm2-calculator-seed{seed}")
    before = summary["evals"]["start"]["greedy"]["success_rate"]
    after = summary["evals"]["final"]["greedy"]["success_rate"]
    print(f"seed {seed}: held-out {before:.1%} -> {after:.1%} in {summary['seconds']}")
    assert after - before >= 0.20


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_smollm2_bfcl_recipe_reports_bfcl_accuracy_per_category(seed, tmp_path):
    summary = _run("smollm2_bfcl.yaml", seed, tmp_path / f"smollm2-bfcl-seed{seed}")
    start, final = summary["evals"]["start"], summary["evals"]["final"]
    assert set(start) == set(final) and len(start) == 4
    for key in start:
        print(f"seed {seed} {key}: {start[key]['success_rate']:.1%} -> {final[key]['success_rate']:.1%}")
