"""Loss options for stale samples, through `miles train`: an asynchronous run with `seq_mask_log_ratio`."""

from __future__ import annotations

from miles.training.config import ASYNC_DUAL_CLIP_C, load_train_config
from tests.support.runs import SHORT_ASYNC, trained_rows


def test_the_sequence_mask_keeps_the_async_defaults():
    lc = load_train_config(
        None,
        ["async.enabled=true", "async.max_staleness=4", "algorithm.loss.seq_mask_log_ratio=0.693"],
    ).algorithm.loss
    assert (lc.ratio_to, lc.dual_clip_c, lc.tis_cap, lc.seq_mask_log_ratio) == (
        "rollout",
        ASYNC_DUAL_CLIP_C,
        None,
        0.693,
    )


def test_an_async_run_with_the_sequence_mask_reports_what_it_masked(tmp_path):
    rows = trained_rows(tmp_path, *SHORT_ASYNC, "algorithm.loss.seq_mask_log_ratio=0.693")
    assert rows and all(0.0 <= r["seq_masked_frac"] <= 1.0 for r in rows)
    assert all("dual_clip_frac" in r and "tis_weight_mean" not in r for r in rows)  # the async defaults stay
