"""`MegatronTrainer`: the `Trainer` protocol (`train_step`, `sft_step`, `hf_state_dict`, ...) on megatron-core.

Every rank calls `train_step` with the same full `TrajectoryBatch` (as with `TorchTrainer`). Advantages are
computed on the whole batch; each data-parallel rank takes a token-balanced contiguous share of every
mini-batch and cuts it into micro-batches of at most ``micro_batch_tokens`` tokens, each one row of packed
sequences in megatron's ``thd`` format (RoPE and causal attention restart per sequence). The pipeline schedule
from ``get_forward_backward_func`` runs them; the loss is the torch backend's `policy_loss` on logprobs taken
from the vocab-parallel logits, normalized by batch-global token/sequence counts, so gradients summed over
micro-batches and data-parallel ranks equal the single-process full-batch gradient.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from miles.learner import checkpoint as ckpt_io
from miles.learner.batching import plan_micro_batches, token_balanced_share
from miles.learner.config import AlgorithmConfig, MegatronTrainerConfig, TrainerConfig, lr_lambda
from miles.learner.errors import CheckpointError, ConfigError
from miles.learner.losses import LossInputs, LossOutput, mismatch_lr_scale, policy_loss, sft_loss
from miles.learner.megatron.compat import label_params_as_cuda
from miles.learner.megatron.convert import hf_to_megatron, megatron_to_hf, tp_partition_dim
from miles.learner.megatron.logprobs import final_hidden_states, head_logprobs
from miles.learner.megatron.model import (
    build_gpt_model,
    layout_from_hf,
    resolve_attention_backend,
    supports_packing,
    transformer_config,
)
from miles.learner.megatron.parallel import ParallelInfo, initialize_parallel
from miles.learner.metrics import MetricAccumulator, reduce_metrics, train_step_metrics
from miles.learner.step import (
    RLStep,
    prepare_rl_step,
    replayed_kept_counts,
    resolve_temperature,
    validate_batch,
)
from miles.trajectory import TrajectoryBatch


@dataclass
class _MicroBatch:
    ids: torch.Tensor  # [1, T]
    cu_seqlens: torch.Tensor  # int32 [n+1], local to the micro-batch
    max_seqlen: int
    token_range: tuple[int, int]  # into the batch's packed tokens
    seq_index: torch.Tensor  # [T]
    starts: torch.Tensor  # [n]
    host_cu_seqlens: list[int] = dataclasses.field(default_factory=list)
    dummy: bool = False  # stands in for a rank with no sequences: its loss is multiplied by 0
    kept_counts: torch.Tensor | None = None  # [T]: the sampler's kept counts to replay (None: no replay)


def _finalize_grads(model: list[nn.Module], num_tokens: Any = None, **kwargs: Any) -> None:
    """Megatron's grad finalization (DP all-reduce, tied-embedding sync) without per-token rescaling:
    our losses are already normalized by the batch-global token counts."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, num_tokens=None, **kwargs)


class MegatronTrainer:
    """Trains a Llama / Qwen2 / Qwen3 policy as a megatron-core ``GPTModel`` with TP / PP / DP (implements
    `miles.learner.protocol.Trainer`).

    ``model``: an HF causal LM (its config and weights are converted; the HF module itself is not kept), or a
    path for ``from_pretrained``; or pass ``hf_config`` alone for a randomly initialized model (benchmarks).
    With ``algorithm.loss.kl_coef > 0`` a second, frozen ``GPTModel`` (same parallel layout) holds the
    reference policy: the initial weights, re-taken from the policy when RL starts after SFT (`begin_sft`).
    Call it on every rank of the job (all ranks construct it and call every method collectively).
    """

    def __init__(
        self,
        model: nn.Module | str | os.PathLike | None = None,
        config: MegatronTrainerConfig | None = None,
        algorithm: AlgorithmConfig | None = None,
        *,
        hf_config: Any = None,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.config = cfg = config or MegatronTrainerConfig()
        self.algorithm = algorithm or AlgorithmConfig()
        if isinstance(model, str | os.PathLike):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(model), torch_dtype=torch.float32)
        if model is not None:
            hf_config = model.config
            state_dict = {k: v.detach() for k, v in model.state_dict().items()}
        if hf_config is None:
            raise ConfigError("model", "MegatronTrainer needs an HF model, a path, or hf_config")
        self.hf_config = hf_config
        self.info: ParallelInfo = initialize_parallel(cfg.tp, cfg.pp, seed=cfg.seed)
        self.layout = layout_from_hf(hf_config, tp_size=cfg.tp, vocab_divisible_by=cfg.vocab_divisible_by)
        on_gpu = self.info.device.type == "cuda"
        self.dtype = (
            torch.bfloat16
            if cfg.precision == "bf16" or (cfg.precision == "auto" and on_gpu)
            else torch.float32
        )
        self.attention = resolve_attention_backend(cfg.attention)
        self.packing = supports_packing(self.attention)
        self.tconfig = transformer_config(
            self.layout,
            tp_size=cfg.tp,
            pp_size=cfg.pp,
            params_dtype=self.dtype,
            calculate_per_token_loss=True,
            **_recompute_settings(cfg.recompute),
        )
        module = self._new_module()
        self.layer_ids = [layer.layer_number - 1 for layer in module.decoder.layers]
        if state_dict is not None:
            self._load_hf(module, state_dict)
        self.ref_model: nn.Module | None = None
        if self.algorithm.needs_reference:
            self.ref_model = self._new_module()
            self.ref_model.load_state_dict(module.state_dict())
            self.ref_model.eval().requires_grad_(False)
        self.model = module
        self._wrap(module)
        self.step = 0
        self.nonfinite_steps = 0  # optimizer steps skipped because their gradient was not finite
        self._in_sft = False
        self._build_optimizer(cfg)

    # ---------------------------------------------------------------- setup

    def _new_module(self) -> nn.Module:
        module = build_gpt_model(self.layout, self.tconfig, attention=self.attention)
        if self.info.device.type == "cuda":
            module.cuda(self.info.device)
        return module

    def _load_hf(self, module: nn.Module, hf: dict[str, torch.Tensor]) -> None:
        shard = hf_to_megatron(
            hf,
            self.layout,
            tp_size=self.info.tp_size,
            tp_rank=self.info.tp_rank,
            layers=self.layer_ids,
            first_stage=self.info.first_stage,
            last_stage=self.info.last_stage,
            te_norms=self.attention == "te",
        )
        own = {k for k in module.state_dict() if not k.endswith("_extra_state")}
        missing, unexpected = sorted(own - set(shard)), sorted(set(shard) - own)
        if missing or unexpected:
            raise ConfigError(
                "model",
                f"HF -> Megatron conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}",
            )
        module.load_state_dict({k: v.to(self.dtype) for k, v in shard.items()}, strict=False)

    def _wrap(self, module: nn.Module) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        cfg = self.config
        label_params_as_cuda(module)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            use_distributed_optimizer=cfg.distributed_optimizer,
            check_for_nan_in_grad=False,
            average_in_collective=False,
        )
        self.ddp = DistributedDataParallel(config=self.tconfig, ddp_config=ddp_config, module=module)
        self.tconfig.no_sync_func = self.ddp.no_sync
        self.tconfig.finalize_model_grads_func = _finalize_grads

    def _build_optimizer(self, schedule: TrainerConfig) -> None:
        """A fresh megatron optimizer whose LR follows ``schedule`` from the current step on."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.config
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=schedule.lr,
            min_lr=0.0,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.betas[0],
            adam_beta2=cfg.betas[1],
            adam_eps=cfg.adam_eps,
            clip_grad=cfg.max_grad_norm or 0.0,
            bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype,
            use_distributed_optimizer=cfg.distributed_optimizer,
        )
        # config_overrides={}: weight decay on every parameter, as torch's AdamW in the torch backend.
        self.optimizer = get_megatron_optimizer(opt_config, [self.ddp], config_overrides={})
        self._schedule = schedule
        self._schedule_start = 0 if schedule is cfg else self.step  # RL's schedule counts the loop's steps

    # ---------------------------------------------------------------- public steps

    def begin_sft(self, lr: float, *, warmup_steps: int = 0) -> None:
        """Following `sft_step` s use their own fresh optimizer at constant `lr` (after linear warmup)."""
        self._build_optimizer(self.config.for_sft(lr, warmup_steps=warmup_steps))
        self._in_sft = True

    def _begin_rl(self) -> None:
        """After SFT: a fresh optimizer at the configured lr, and the SFT'd policy as the KL reference."""
        self._build_optimizer(self.config)
        if self.ref_model is not None:
            self.ref_model.load_state_dict(self.model.state_dict())
        self._in_sft = False

    def train_step(self, batch: TrajectoryBatch) -> dict[str, float]:
        """One RL update (``num_mini_batches * ppo_epochs`` optimizer steps) on ``batch``; returns metrics."""
        t0 = time.perf_counter()
        if self._in_sft:
            self._begin_rl()
        rl = prepare_rl_step(batch, self.algorithm, self.config.temperature)
        old_lp = self._logprobs_of(self.ddp, rl.batch, rl.temperature) if rl.needs_old_logprobs else None
        ref_lp = (
            self._logprobs_of(self.ref_model, rl.batch, rl.temperature)
            if self.ref_model is not None
            else None
        )
        metrics = MetricAccumulator()
        grad_norms, losses, lrs, lr_scales, passes = [], [], [], [], 0
        skipped_before = self.nonfinite_steps
        target = self.algorithm.loss.mismatch_kl_target
        for mini in rl.mini_batches():
            loss_fn = partial(
                self._policy_loss,
                rl=rl,
                old_lp=old_lp,
                ref_lp=ref_lp,
                num_tokens=mini.num_tokens,
                num_seqs=mini.num_seqs,
            )
            lrs.append(self._set_lr())
            loss, norm, n = self._optimizer_step(
                rl.batch,
                list(range(mini.lo, mini.hi)),
                loss_fn,
                metrics,
                mismatch_kl_target=target,
                scales=lr_scales,
            )
            losses.append(loss)
            grad_norms.append(norm)
            passes += n
        result = reduce_metrics(metrics)
        if lr_scales:
            result["lr_scale"] = sum(lr_scales) / len(lr_scales)
        result.update(
            train_step_metrics(
                rl.batch,
                adv_seq=rl.adv_seq,
                losses=losses,
                grad_norms=grad_norms,
                step=self.step,
                temperature=rl.temperature,
                lr=lrs[-1] if lrs else self._lr(),
                t0=t0,
                micro_batches=passes,
                nonfinite_steps=self.nonfinite_steps - skipped_before,
            )
        )
        return result

    def sft_step(self, batch: TrajectoryBatch) -> dict[str, float]:
        """One supervised step: token-mean cross-entropy on loss-masked tokens (temperature 1)."""
        t0 = time.perf_counter()
        batch = validate_batch(batch)
        num_tokens = float(batch.loss_mask.sum())
        metrics = MetricAccumulator()
        lr = self._set_lr()
        loss, norm = 0.0, 0.0
        if num_tokens > 0:
            loss_fn = partial(self._sft_loss, batch=batch, num_tokens=num_tokens)
            loss, norm, _ = self._optimizer_step(batch, list(range(batch.num_sequences)), loss_fn, metrics)
        result = reduce_metrics(metrics)
        result.update(
            {
                "loss": loss,
                "grad_norm": norm,
                "lr": lr,
                "num_train_tokens": num_tokens,
                "step": float(self.step),
                "step_time_s": time.perf_counter() - t0,
            }
        )
        return result

    def compute_logprobs(self, batch: TrajectoryBatch, *, temperature: float | None = None) -> torch.Tensor:
        """Logprobs ``[T]`` of every token under the current policy (0 at sequence starts), on every rank."""
        batch = validate_batch(batch)
        override = self.config.temperature if temperature is None else temperature
        return self._logprobs_of(self.ddp, batch, resolve_temperature(batch, override))

    @torch.no_grad()
    def _logprobs_of(self, model: nn.Module, batch: TrajectoryBatch, temperature: float) -> torch.Tensor:
        """`compute_logprobs` under `model` (the policy's DDP wrapper or the reference module), on CPU."""
        out = torch.zeros(batch.token_ids.numel(), dtype=torch.float32, device=self.info.device)

        def collect(mb: _MicroBatch, module: nn.Module, hidden: torch.Tensor) -> LossOutput:
            lp, _ = self._logprobs(mb, module, hidden, temperature)
            if not mb.dummy and self._reports():
                out[mb.token_range[0] : mb.token_range[1]] = lp.float()
            return LossOutput(loss=lp.sum() * 0.0)

        self._run(
            batch,
            list(range(batch.num_sequences)),
            collect,
            MetricAccumulator(),
            forward_only=True,
            model=model,
        )
        dist.all_reduce(out)  # each token is written by exactly one (last-stage, tp-rank-0) rank
        return out.cpu()

    def hf_state_dict(self, *, cpu: bool = False) -> dict[str, torch.Tensor]:
        """A snapshot of the full model under HF names (copies, never views of the live parameters), on
        every rank (a collective: call it on all ranks).

        TP shards are all-gathered and merged; pipeline stages broadcast their tensors to every rank.
        """
        info = self.info
        from megatron.core import parallel_state as ps

        local = {k: v.detach() for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        shards: list[dict[str, torch.Tensor]] = [dict() for _ in range(info.tp_size)]
        for name, t in local.items():
            dim = tp_partition_dim(name)
            if dim is None or info.tp_size == 1:
                for s in shards:
                    s[name] = t
            else:
                parts = [torch.empty_like(t) for _ in range(info.tp_size)]
                dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
                for s, p in zip(shards, parts, strict=True):
                    s[name] = p
        hf = megatron_to_hf(shards, self.layout, layers=self.layer_ids, te_norms=self.attention == "te")
        if info.pp_size > 1:
            hf = self._gather_stages(hf)
        # The conversion returns views of live parameters where it can (tp=1): copy them.
        return {k: v.to("cpu" if cpu else v.device, copy=True) for k, v in hf.items()}

    def save_pretrained(self, directory: str | Path) -> None:
        """Write the policy as an ordinary HF checkpoint (collective; rank 0 writes)."""
        sd = self.hf_state_dict(cpu=True)
        if self.info.rank == 0:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(self.hf_config)
            model.load_state_dict(sd, strict=False)
            model.save_pretrained(str(directory))
        dist.barrier()

    def save_checkpoint(
        self,
        root: str | Path,
        *,
        data_cursor: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        keep_last: int | None = None,
    ) -> Path | None:
        """Save model (HF layout), optimizer, step, RNG (all ranks) and ``data_cursor`` under ``root``.

        The on-disk format of `miles.learner.checkpoint`; ``optimizer.pt`` holds every rank's optimizer
        shard, so a resume needs the same tp / pp / world size. A collective: rank 0 writes and returns the
        path, the other ranks return None.
        """
        model_state = self.hf_state_dict(cpu=True)
        local = (self._optimizer_state(), ckpt_io.capture_rng_state())
        gathered: list[Any] = [None] * self.info.world_size
        if self.info.world_size == 1:
            gathered = [local]
        else:
            dist.all_gather_object(gathered, local)
        path = None
        if self.info.rank == 0:
            optimizer_state = {
                "backend": "megatron",
                **self._optimizer_layout(),
                "ranks": [g[0] for g in gathered],
            }
            path = ckpt_io.save_checkpoint(
                root,
                step=self.step,
                model_state=model_state,
                optimizer_state=optimizer_state,
                data_cursor=data_cursor,
                extra=extra,
                rng_states=[g[1] for g in gathered],
                keep_last=keep_last,
            )
        if self.info.world_size > 1:
            dist.barrier()
        return path

    def load_checkpoint(self, path: str | Path) -> ckpt_io.Checkpoint:
        """Restore what `save_checkpoint` wrote (``path``: a checkpoint or its root); a collective, every rank
        reads the files. Raises `CheckpointError` when the checkpoint does not fit this model or layout."""
        ckpt = ckpt_io.load_checkpoint(path)
        opt = ckpt.optimizer
        if opt is not None:
            if not isinstance(opt, dict) or opt.get("backend") != "megatron":
                raise CheckpointError(f"{ckpt.path}: the optimizer state is not the Megatron backend's")
            saved = {k: opt.get(k) for k in self._optimizer_layout()}
            if saved != self._optimizer_layout():
                raise CheckpointError(
                    f"{ckpt.path}: the optimizer state was saved with {saved}, this run has "
                    f"{self._optimizer_layout()}"
                )
        try:
            self._load_hf(self.model, ckpt.model)
        except (ConfigError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"{ckpt.path}: checkpoint weights do not fit this model: {e}") from e
        if opt is not None:
            self._load_optimizer_state(opt["ranks"][self.info.rank])
        self.step = ckpt.step
        if ckpt.rng:
            ckpt_io.restore_rng_state(
                ckpt.rng[self.info.rank] if self.info.rank < len(ckpt.rng) else ckpt.rng[0]
            )
        if self.info.world_size > 1:
            dist.barrier()
        return ckpt

    # ---------------------------------------------------------------- internals

    def _optimizer_layout(self) -> dict[str, Any]:
        """What the per-rank optimizer shards depend on: a checkpoint resumes only into the same layout."""
        return {
            "tp": self.info.tp_size,
            "pp": self.info.pp_size,
            "world_size": self.info.world_size,
            "distributed_optimizer": self.config.distributed_optimizer,
        }

    def _sub_optimizers(self) -> list[Any]:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def _optimizer_state(self) -> list[dict[str, Any]]:
        """This rank's optimizer shard, per megatron sub-optimizer: the inner torch optimizer's state dict
        and its main (fp32 master) parameters, on CPU."""
        out = []
        for sub in self._sub_optimizers():
            inner = sub.optimizer
            main = [p.detach().cpu().clone() for g in inner.param_groups for p in g["params"]]
            out.append({"inner": _to_cpu(inner.state_dict()), "main": main})
        return out

    def _load_optimizer_state(self, state: list[dict[str, Any]]) -> None:
        subs = self._sub_optimizers()
        if len(state) != len(subs):
            raise CheckpointError(f"optimizer state has {len(state)} parts, this optimizer {len(subs)}")
        for sub, part in zip(subs, state, strict=True):
            inner = sub.optimizer
            params = [p for g in inner.param_groups for p in g["params"]]
            if [tuple(p.shape) for p in params] != [tuple(m.shape) for m in part["main"]]:
                raise CheckpointError("optimizer shards do not match this model's parameters")
            try:
                inner.load_state_dict(part["inner"])
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"optimizer state does not fit: {e}") from e
            with torch.no_grad():
                for p, m in zip(params, part["main"], strict=True):
                    p.copy_(m)

    def _gather_stages(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from megatron.core import parallel_state as ps

        group = ps.get_pipeline_model_parallel_group()
        ranks = dist.get_process_group_ranks(group)
        metas: list[Any] = [None] * len(ranks)
        dist.all_gather_object(metas, {k: (tuple(v.shape), v.dtype) for k, v in hf.items()}, group=group)
        merged: dict[str, torch.Tensor] = {}
        for stage, meta in enumerate(metas):
            for name, (shape, dtype) in sorted(meta.items()):
                t = (
                    hf[name].contiguous()
                    if stage == self.info.pp_rank
                    else torch.empty(shape, dtype=dtype, device=self.info.device)
                )
                dist.broadcast(t, src=ranks[stage], group=group)
                merged[name] = t
        return merged

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _set_lr(self) -> float:
        lr = self._schedule.lr * lr_lambda(self.step - self._schedule_start, self._schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _reports(self) -> bool:
        """Exactly one rank per data-parallel replica owns the loss values: last stage, TP rank 0."""
        return self.info.last_stage and self.info.tp_rank == 0

    def _micro_batches(self, batch: TrajectoryBatch, seqs: list[int]) -> list[_MicroBatch]:
        lo, hi = seqs[0], seqs[-1] + 1
        lengths = (batch.cu_seqlens[lo + 1 : hi + 1] - batch.cu_seqlens[lo:hi]).tolist()
        dummy = False
        if self.info.dp_size > 1:
            a, b = token_balanced_share(lengths, self.info.dp_rank, self.info.dp_size)
            if a == b:  # more ranks than sequences: run the first sequence with a zero loss
                a, b, dummy = 0, 1, True
            lengths, lo = lengths[a:b], lo + a
        budget = self.config.micro_batch_tokens if self.packing else 1
        out = []
        for s, e in plan_micro_batches(lengths, budget):
            start, end = lo + s, lo + e
            cu = batch.cu_seqlens[start : end + 1] - batch.cu_seqlens[start]
            tl, th = int(batch.cu_seqlens[start]), int(batch.cu_seqlens[end])
            seq_len = cu[1:] - cu[:-1]
            dev = self.info.device
            out.append(
                _MicroBatch(
                    ids=batch.token_ids[tl:th].unsqueeze(0).to(dev),
                    cu_seqlens=cu.to(torch.int32).to(dev),
                    max_seqlen=int(seq_len.max()),
                    token_range=(tl, th),
                    seq_index=torch.repeat_interleave(torch.arange(seq_len.numel()), seq_len).to(dev),
                    starts=cu[:-1].to(dev),
                    host_cu_seqlens=cu.tolist(),
                    dummy=dummy,
                    kept_counts=replayed_kept_counts(batch, self.config.sampling_mask, tl, th, dev),
                )
            )
        return out

    def _forward_step(
        self,
        data_iterator: Iterator[_MicroBatch],
        model: nn.Module,
        loss_fn: Callable[[_MicroBatch, nn.Module, torch.Tensor], LossOutput],
        sink: list,
    ) -> Any:
        from megatron.core.packed_seq_params import PackedSeqParams

        mb = next(data_iterator)
        with final_hidden_states(model) as hidden:  # the output layer is applied by the loss, chunk by chunk
            if self.packing:
                packed = PackedSeqParams(
                    qkv_format="thd",
                    cu_seqlens_q=mb.cu_seqlens,
                    cu_seqlens_kv=mb.cu_seqlens,
                    max_seqlen_q=mb.max_seqlen,
                    max_seqlen_kv=mb.max_seqlen,
                )
                packed.host_cu_seqlens = mb.host_cu_seqlens  # read by SDPAttention
                output = model(mb.ids, None, None, packed_seq_params=packed)
            else:
                positions = torch.arange(mb.ids.size(1), device=mb.ids.device).unsqueeze(0)
                output = model(mb.ids, positions, None)

        def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
            out = loss_fn(mb, model, hidden[0])
            loss = out.loss * 0.0 if mb.dummy else out.loss
            if not mb.dummy:
                sink.append(out)
            return loss, torch.tensor(mb.ids.size(1), dtype=torch.int, device=loss.device), {}

        return output, loss_func

    def _run(
        self,
        batch: TrajectoryBatch,
        seqs: list[int],
        loss_fn: Callable[[_MicroBatch, nn.Module, torch.Tensor], LossOutput],
        metrics: MetricAccumulator,
        *,
        forward_only: bool = False,
        model: nn.Module | None = None,
    ) -> tuple[float, int]:
        """Forward (and backward) every micro-batch of this rank's share of ``seqs`` through ``model`` (default:
        the policy); returns the summed loss and the number of micro-batches."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        mbs = self._micro_batches(batch, seqs)
        sink: list[LossOutput] = []
        forward_backward = get_forward_backward_func()
        forward_backward(
            forward_step_func=partial(self._forward_step, loss_fn=loss_fn, sink=sink),
            data_iterator=iter(mbs),
            model=[model or self.ddp],
            num_microbatches=len(mbs),
            seq_length=max(mb.ids.size(1) for mb in mbs),
            micro_batch_size=1,
            forward_only=forward_only,
        )
        total = 0.0
        if self._reports():
            for out in sink:
                total += float(out.loss.detach())
                metrics.update(out.metric_sums)
        return total, len(mbs)

    def _optimizer_step(
        self,
        batch: TrajectoryBatch,
        seqs: list[int],
        loss_fn: Callable[[_MicroBatch, nn.Module, torch.Tensor], LossOutput],
        metrics: MetricAccumulator,
        *,
        mismatch_kl_target: float | None = None,
        scales: list[float] | None = None,
    ) -> tuple[float, float, int]:
        """Returns the summed loss over all ranks, the gradient norm and this rank's micro-batch count. With
        `mismatch_kl_target` the step runs at `mismatch_lr_scale` times the learning rate `_set_lr` set (the
        factor is appended to `scales`)."""
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        step_metrics = MetricAccumulator()
        local, passes = self._run(batch, seqs, loss_fn, step_metrics)
        metrics.update(step_metrics.sums())
        if mismatch_kl_target is not None:
            # only the reporting ranks hold loss metrics; the sum over all ranks gives every rank one factor
            pair = step_metrics.sums().get("mismatch_kl", (0.0, 0.0))
            mismatch = torch.tensor(pair, dtype=torch.float64, device=self.info.device)
            dist.all_reduce(mismatch)
            kl_sum, kl_count = mismatch.tolist()
            scale = mismatch_lr_scale((kl_sum, kl_count), mismatch_kl_target)
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * scale
            if scales is not None:
                scales.append(scale)
        if self._gradients_finite():
            _, grad_norm, _ = self.optimizer.step()
        else:  # a NaN or inf gradient would poison every weight: skip the update
            self.nonfinite_steps += 1
            self.optimizer.zero_grad()
            grad_norm = float("nan")
        self.step += 1
        total = torch.tensor([local], dtype=torch.float64, device=self.info.device)
        dist.all_reduce(total)
        return float(total), float(grad_norm or 0.0), passes

    def _gradients_finite(self) -> bool:
        """Whether every rank's gradients are finite (a collective: every rank gets the same answer)."""
        bad = torch.zeros(1, dtype=torch.float32, device=self.info.device)
        for p in self.ddp.parameters():
            grad = getattr(p, "main_grad", None)
            grad = p.grad if grad is None else grad
            if grad is not None and not bool(torch.isfinite(grad).all()):
                bad.fill_(1.0)
                break
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad.item())

    def _logprobs(
        self,
        mb: _MicroBatch,
        model: nn.Module,
        hidden: torch.Tensor,
        temperature: float,
        *,
        entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return head_logprobs(
            model,
            hidden,
            mb.ids[0],
            mb.starts,
            self.layout.vocab_size,
            temperature,
            entropy=entropy,
            kept_counts=mb.kept_counts,
        )

    def _policy_loss(
        self,
        mb: _MicroBatch,
        model: nn.Module,
        hidden: torch.Tensor,
        *,
        rl: RLStep,
        old_lp: torch.Tensor | None,
        ref_lp: torch.Tensor | None,
        num_tokens: float,
        num_seqs: float,
    ) -> LossOutput:
        lc = self.algorithm.loss
        lp, ent = self._logprobs(
            mb, model, hidden, rl.temperature, entropy=self.config.compute_entropy or lc.entropy_coef != 0
        )
        if ent is not None and lc.entropy_coef == 0:
            ent = ent.detach()
        tl, th = mb.token_range
        dev = lp.device

        def sl(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[tl:th].to(dev)

        inputs = LossInputs(
            logprobs=lp,
            old_logprobs=sl(old_lp) if old_lp is not None else lp.detach(),
            advantages=sl(rl.adv_tok),
            loss_mask=sl(rl.batch.loss_mask),
            seq_index=mb.seq_index,
            rollout_logprobs=sl(rl.batch.rollout_logprobs),
            ref_logprobs=sl(ref_lp),
            entropy=ent,
            turn_index=sl(rl.batch.turn_index),
        )
        return policy_loss(inputs, lc, num_tokens=num_tokens, num_seqs=num_seqs)

    def _sft_loss(
        self,
        mb: _MicroBatch,
        model: nn.Module,
        hidden: torch.Tensor,
        *,
        batch: TrajectoryBatch,
        num_tokens: float,
    ) -> LossOutput:
        lp, _ = self._logprobs(mb, model, hidden, 1.0)
        tl, th = mb.token_range
        return sft_loss(lp, batch.loss_mask[tl:th].to(lp.device), num_tokens=num_tokens)


def _recompute_settings(recompute: str) -> dict[str, Any]:
    """``TransformerConfig`` fields for `MegatronOptions.recompute`."""
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if recompute == "selective":
        return {"recompute_granularity": "selective"}
    return {}


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_to_cpu(v) for v in x)
    return x
