"""Sampling-mask replay: under top-k/top-p the engine reports each token's logprob under the distribution it
sampled from and how many tokens its filter kept; the trainer renormalises over its own that-many largest logits.
So at step 0 (fp32, the tiny model on the CPU) no importance ratio leaves [0.9, 1.1] with top-p 0.8 or top-k 5,
as with top-p 1, while without the replay (`trainer.sampling_mask: false`) many do. Checked on the engine's
sampler alone (a property), on rollouts of the embedded engine against both trainer backends, through records
and batches, and end to end with `miles train` on the calculator example."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.engine import FinishReason, GenerateResult, SamplingParams
from miles.engines import wire
from miles.engines.embedded import EmbeddedEngine
from miles.engines.sampling import RowSampling, SampleMode, SamplingTensors, _filter_top_k_top_p, sample
from miles.engines.testing import ServerProcess
from miles.learner.logprobs import keep_top_counts, shifted_token_logprobs
from miles.learner.torch_backend import TorchTrainer, TorchTrainerConfig
from miles.sessions.records import SessionRecord
from miles.tiny import make_tiny_model
from miles.trajectory import Trajectory, TrajectoryBatch, TrajectoryMeta

REPO = Path(__file__).resolve().parents[2]

# (top_p, top_k): the filters under test, and the unfiltered reference
FILTERS = [(0.8, -1), (1.0, 5)]
REFERENCE = (1.0, -1)


def outside(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> float:
    """The share of masked tokens whose ratio exp(train - rollout) lies outside [0.9, 1.1]."""
    ratio = torch.exp(train - rollout)[mask > 0]
    return float(((ratio < 0.9) | (ratio > 1.1)).double().mean())


# ------------------------------------------------------------------ the sampler's counts replay its logprobs

logits_st = st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=2, max_size=60)


@settings(max_examples=150, deadline=None)
@given(
    values=logits_st,
    temperature=st.floats(0.3, 2.0),
    top_k=st.integers(-1, 20),
    top_p=st.floats(0.05, 1.0),
    key=st.integers(0, 2**32 - 1),
)
def test_the_kept_count_reproduces_the_engines_renormalised_logprob(values, temperature, top_k, top_p, key):
    logits = torch.tensor([values])
    row = RowSampling(temperature, top_p, top_k, key)
    token, logprob, kept = (
        x[0] for x in sample(logits, SamplingTensors.build([row], [0], "cpu"), SampleMode.of([row]))
    )
    scaled = logits / temperature
    survivors = torch.isfinite(_filter_top_k_top_p(scaled, torch.tensor([top_k]), torch.tensor([top_p])))[0]
    # the sampler sees top_p in float32 (0.99..9 -> 1.0: no filter)
    if not (top_k > 0 or float(torch.tensor(top_p, dtype=torch.float32)) < 1.0):
        assert int(kept) == 0
    else:
        assert int(kept) == int(survivors.sum())  # the count is the size of the set sampled from
        expected = torch.log_softmax(scaled[0].masked_fill(~survivors, float("-inf")), -1)[token]
        assert float(logprob) == pytest.approx(float(expected), abs=1e-5)
    # the trainer, from the count alone: the token and the `kept - 1` largest other logits of its own
    ids = torch.tensor([0, int(token)])
    counts = torch.tensor([0, int(kept)])
    replayed = shifted_token_logprobs(
        torch.cat([logits, logits]), ids, torch.tensor([0]), temperature, counts
    )
    assert float(replayed[1]) == pytest.approx(float(logprob), abs=1e-5)
    kept_set = keep_top_counts(scaled, counts[1:], ids[1:]) > -1e29
    if int(kept):  # the same number of tokens, none of them less likely than a token the engine dropped
        assert int(kept_set.sum()) == int(kept)
        dropped = scaled[0][~survivors]
        if dropped.numel():
            assert float(scaled[0][kept_set[0]].min()) >= float(dropped.max())


def test_the_kept_set_has_exactly_count_tokens_with_the_token_among_them():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, 2.0], [0.0, 1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    kept = keep_top_counts(logits, torch.tensor([3, 0, 2]), torch.tensor([4, 1, 3])) > -1e29
    assert kept[0].tolist() == [True, False, True, False, True]  # the token (a 2.0) and the 2 largest others
    assert kept[1].all()  # count 0: the whole vocabulary
    assert kept[2].tolist() == [True, False, False, True, False]  # ties: the token, then vocabulary order
    below = keep_top_counts(logits[:1], torch.tensor([2]), torch.tensor([3])) > -1e29
    assert below[0].tolist() == [True, False, False, True, False]  # ranked below the cut: still 2 tokens


# ------------------------------------------------------------------ records and batches carry the counts


def _trajectory(counts: list[int] | None, group: str = "g") -> Trajectory:
    t = Trajectory(meta=TrajectoryMeta(group_id=group))
    t.append([1, 2, 3], role="prompt", generated=False)
    t.append([4, 5], role="assistant", generated=True, logprobs=[-0.5, -0.25], kept_counts=counts)
    t.append([6], role="observation", generated=False)
    t.append(
        [7], role="assistant", generated=True, logprobs=[-0.125], kept_counts=None if counts is None else [9]
    )
    return t


def test_kept_counts_round_trip_through_records_and_batches(tmp_path):
    with_counts, without = _trajectory([3, 1]), _trajectory(None)
    assert with_counts.kept_counts == [0, 0, 0, 3, 1, 0, 9]
    assert without.kept_counts == [] and "kept_counts" not in without.to_dict()  # old records read the same
    assert Trajectory.from_json(with_counts.to_json()).kept_counts == with_counts.kept_counts
    record = SessionRecord(session_id="s", trajectory=with_counts)
    assert SessionRecord.from_dict(json.loads(json.dumps(record.to_dict()))).trajectory.kept_counts == [
        0, 0, 0, 3, 1, 0, 9,
    ]  # fmt: skip
    batch = TrajectoryBatch.from_trajectories([without, with_counts])
    assert batch.kept_counts.tolist() == [0] * 7 + with_counts.kept_counts
    assert batch.select([1]).kept_counts.tolist() == with_counts.kept_counts
    batch.save(tmp_path / "b.safetensors")
    assert torch.equal(TrajectoryBatch.load(tmp_path / "b.safetensors").kept_counts, batch.kept_counts)
    assert TrajectoryBatch.from_trajectories([without]).kept_counts is None
    with pytest.raises(ValueError, match="kept_counts"):
        Trajectory(token_ids=[1, 2], loss_mask=[0, 1], rollout_logprobs=[0.0, -1.0], kept_counts=[2, 1])


def test_the_embedded_servers_kept_counts_cross_the_wire_and_sglangs_absence_means_none():
    result = GenerateResult([4, 5], [-0.5, -0.25], FinishReason.STOP, 3, kept_counts=[7, 1])
    data = wire.generate_response(result, rid="r", text="x", return_logprob=True)
    assert wire.parse_generate_response(data).kept_counts == [7, 1]
    plain = GenerateResult([4, 5], [-0.5, -0.25], FinishReason.STOP, 3)
    data = wire.generate_response(plain, rid="r", text="x", return_logprob=True)
    assert wire.KEPT_COUNTS_FIELD not in data["meta_info"]  # SGLang's own shape: no kept set, no replay
    assert wire.parse_generate_response(data).kept_counts is None
    data["meta_info"][wire.KEPT_COUNTS_FIELD] = [1]
    with pytest.raises(wire.WireFormatError, match="one count per token"):
        wire.parse_generate_response(data)
    data["meta_info"][wire.KEPT_COUNTS_FIELD] = [1, "x"]
    with pytest.raises(wire.WireFormatError):
        wire.parse_generate_response(data)


def test_an_agents_sessions_through_the_openai_endpoint_record_the_kept_counts():
    """The OpenAI-compatible endpoint (external agents) records each generated token's kept count too."""
    from openai import OpenAI

    from miles.sessions.instant import InstantEngine
    from miles.sessions.openai.config import OpenAISessionConfig
    from miles.sessions.openai.endpoint import OpenAIEndpoint
    from tests.support.openai import calculator_script, direct, drive, served, tito

    class Filtering(InstantEngine):  # a scripted model that reports a kept count of 3 per token
        async def generate(self, input_ids, sampling_params, **kw):
            result = await super().generate(input_ids, sampling_params, **kw)
            return dataclasses.replace(result, kept_counts=[3] * len(result.output_ids))

    t, script = tito("tiny"), calculator_script()
    _, outputs = direct(t, script)
    endpoint = OpenAIEndpoint(
        Filtering([list(o) for o in outputs]), tokenizer=t, config=OpenAISessionConfig(parser="hermes")
    )
    with served(endpoint) as url:
        drive(OpenAI(base_url=f"{url}/v1", api_key="s1", max_retries=0), script, top_p=0.8)
        OpenAI(base_url=url, api_key="s1").post("/sessions/s1/close", cast_to=object)
    traj = endpoint.closed["s1"].result[0].trajectory
    assert traj.kept_counts == [3 * m for m in traj.loss_mask] and sum(traj.loss_mask) > 0


# ------------------------------------------------------------------ embedded engine rollouts, both backends


def _rollouts(model: torch.nn.Module, top_p: float, top_k: int) -> list[Trajectory]:
    """16 sequences from the embedded engine at temperature 1 with these filters, as trajectories."""

    async def run() -> list[Trajectory]:
        engine = EmbeddedEngine(copy.deepcopy(model), max_batch_size=16, cuda_graphs=False, stop_at_eos=False)
        try:
            params = [
                SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k, max_new_tokens=12, seed=i)
                for i in range(16)
            ]
            prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + i % 4)] for i in range(16)]
            results = await asyncio.gather(
                *(engine.generate(p, s) for p, s in zip(prompts, params, strict=True))
            )
        finally:
            await engine.close()
        out = []
        for i, (prompt, p, r) in enumerate(zip(prompts, params, results, strict=True)):
            assert (r.kept_counts is not None) == (top_p < 1 or top_k > 0)
            t = Trajectory(meta=TrajectoryMeta(group_id=str(i % 4), sampling_params=p.to_dict()))
            t.append(prompt, role="prompt", generated=False)
            t.append(
                r.output_ids,
                role="assistant",
                generated=True,
                logprobs=r.output_logprobs,
                weight_version=r.weight_version,
                kept_counts=r.kept_counts,
            )
            out.append(t)
        return out

    return asyncio.run(run())


def _fractions(trainer, batch: TrajectoryBatch) -> tuple[float, float]:
    """(with replay, without) out-of-[0.9, 1.1] fractions of the trainer's step-0 logprobs against the engine's."""
    found = []
    for replay in (True, False):
        trainer.config = dataclasses.replace(trainer.config, sampling_mask=replay)
        lp = trainer.compute_logprobs(batch)
        found.append(outside(lp, batch.rollout_logprobs, batch.loss_mask))
    trainer.config = dataclasses.replace(trainer.config, sampling_mask=True)
    return found[0], found[1]


def _check_backend(make_trainer) -> None:
    model = make_tiny_model("0.1m", seed=3)
    trainer = make_trainer(copy.deepcopy(model))
    reference = TrajectoryBatch.from_trajectories(_rollouts(model, *REFERENCE))
    assert reference.kept_counts is None
    base, _ = _fractions(trainer, reference)
    assert base == 0.0
    for top_p, top_k in FILTERS:
        batch = TrajectoryBatch.from_trajectories(_rollouts(model, top_p, top_k))
        assert batch.kept_counts is not None and int(batch.kept_counts.max()) > 0
        replayed, plain = _fractions(trainer, batch)
        assert replayed == base, (top_p, top_k, replayed)  # the same as top-p 1: none outside
        assert plain > 0.5, (top_p, top_k, plain)  # the full softmax puts most ratios far below 1
        metrics = trainer.train_step(batch)  # the loss path replays too: its own tail metric is 0
        assert metrics["ratio_outside_10pct"] == 0.0 and metrics["log_ratio_abs_max"] < 1e-4


def test_torch_trainer_replays_the_engines_kept_sets_at_step_0():
    _check_backend(lambda m: TorchTrainer(m, TorchTrainerConfig(lr=1e-3, device="cpu")))


def test_megatron_trainer_replays_the_engines_kept_sets_at_step_0(megatron_process):
    from miles.learner.megatron import MegatronTrainer, MegatronTrainerConfig

    _check_backend(lambda m: MegatronTrainer(m, MegatronTrainerConfig(lr=1e-3)))


# ------------------------------------------------------------------ end to end: `miles train`, the config key


def _train_row(out: Path, *sets: str) -> dict:
    args = [sys.executable, "-m", "miles.cli", "train", "--config", str(REPO / "configs" / "calculator.yaml")]
    args += ["--output-dir", str(out)]
    for s in ("steps=1", "eval.num_tasks=2", "max_seconds=null", *sets):
        args += ["--set", s]
    proc = subprocess.run(
        args,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["kind"] == "train")


TOP_P = "rollout.scheduler.session.sampling.top_p=0.8"


def test_miles_train_at_top_p_0_8_replays_the_mask_unless_told_not_to(tmp_path):
    replayed = _train_row(tmp_path / "on", TOP_P)  # trainer.sampling_mask defaults to true
    plain = _train_row(tmp_path / "off", TOP_P, "trainer.sampling_mask=false")
    assert replayed["ratio_outside_10pct"] == 0.0 and replayed["log_ratio_abs_max"] < 1e-4
    assert plain["ratio_outside_10pct"] > 0.0 and plain["mismatch_abs"] > 100 * replayed["mismatch_abs"]


@pytest.mark.slow
def test_miles_train_replays_the_mask_through_the_embedded_http_server(tmp_path):
    server = ServerProcess(REPO / "checkpoints" / "calculator-sft-1m")
    try:
        row = _train_row(tmp_path / "http", TOP_P, "engine.kind=sglang", f"engine.urls=[{server.url}]")
    finally:
        server.kill()
    assert row["ratio_outside_10pct"] == 0.0 and row["log_ratio_abs_max"] < 1e-4
