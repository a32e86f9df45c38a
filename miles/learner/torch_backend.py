"""`TorchTrainer`: GRPO/PPO and SFT steps for any HF causal LM on CPU or CUDA, FSDP2 when distributed.

Sequences are packed padding-free into micro-batches of at most ``micro_batch_tokens`` tokens: one row of
concatenated sequences whose ``position_ids`` restart at 0 for each sequence. Packing modes:

- ``packed``: position ids only; transformers (>= 4.54) turns them into varlen flash calls, or for sdpa into a
  block-diagonal ``L x L`` mask (correct, but quadratic in the packed length);
- ``varlen`` (``auto`` on a CPU): the model's attention is switched to `miles.learner.varlen_attention`
  (causal SDPA over the row's sequences bucketed by length; plain sdpa everywhere else), so no cross-sequence
  attention and no ``L x L`` mask;
- ``padded`` (``auto`` on a GPU, and for models without custom attention functions): right-padded
  micro-batches with an attention mask.

With a world size above 1 every rank calls `train_step` with the same full batch; the trainer computes
advantages on the whole batch (groups may span ranks), takes its own share of the sequences, and
normalizes the loss by batch-global token/sequence counts so the update equals the single-process one.
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from miles.learner.batching import plan_micro_batches, token_balanced_share
from miles.learner.checkpoint import (
    Checkpoint,
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from miles.learner.config import AlgorithmConfig, TorchTrainerConfig, TrainerConfig, lr_lambda
from miles.learner.errors import CheckpointError
from miles.learner.logprobs import (
    lm_head_bypassed,
    shifted_entropy,
    shifted_token_logprobs,
    token_logprobs_from_hidden,
)
from miles.learner.losses import LossInputs, mismatch_lr_scale, policy_loss, sft_loss
from miles.learner.master_weights import MasterWeights
from miles.learner.metrics import MetricAccumulator, reduce_metrics, train_step_metrics
from miles.learner.step import (
    RLStep,
    prepare_rl_step,
    replayed_kept_counts,
    resolve_temperature,
    validate_batch,
)
from miles.trajectory import TrajectoryBatch

from . import varlen_attention

__all__ = ["AlgorithmConfig", "TorchTrainer", "TorchTrainerConfig", "fused_lm_head", "hf_token_logprobs"]


class TorchTrainer:
    """Trains an HF causal LM on `TrajectoryBatch` es (implements `miles.learner.protocol.Trainer`).

    ``model`` is any ``transformers`` causal LM (``model(input_ids, position_ids=...) -> .logits``).
    With ``algorithm.loss.kl_coef > 0`` a frozen reference policy gives the KL term's logprobs: ``ref_model``
    when passed, else a copy of ``model`` as given (the initial policy), re-taken from the policy when RL
    starts after SFT (`begin_sft`). When ``torch.distributed`` is initialized with world size > 1 the policy
    (and the reference) is wrapped with FSDP2 (``fully_shard`` on every no-split decoder layer, then on the
    root), and every method is a collective that all ranks call with the same arguments.
    """

    def __init__(
        self,
        model: nn.Module,
        config: TorchTrainerConfig | None = None,
        algorithm: AlgorithmConfig | None = None,
        *,
        ref_model: nn.Module | None = None,
    ) -> None:
        self.config = config or TorchTrainerConfig()
        self.algorithm = algorithm or AlgorithmConfig()
        self.device = _resolve_device(self.config.device)
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world_size > 1 else 0
        self.use_bf16 = self.config.precision == "bf16" or (
            self.config.precision == "auto" and self.device.type == "cuda"
        )
        self.step = 0
        self.nonfinite_steps = 0  # optimizer steps skipped because their gradient was not finite
        model.to(self.device)
        self._ref_follows_policy = ref_model is None
        if ref_model is None and self.algorithm.needs_reference:
            ref_model = copy.deepcopy(model)
        if self.config.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable()
        self.fsdp = self.world_size > 1
        if ref_model is not None:
            ref_model.to(self.device).eval().requires_grad_(False)
        # bf16: one process keeps float32 masters of bf16 parameters; FSDP2 keeps float32 shards and casts the
        # gathered parameters to bf16 (its mixed-precision policy), reducing gradients in float32.
        self.masters: MasterWeights | None = None
        if self.use_bf16 and not self.fsdp:
            self.masters = MasterWeights([p for p in model.parameters() if p.requires_grad])
            for m in (model, ref_model):
                if m is not None:
                    _params_to_bf16(m)
        if self.fsdp:
            for m in (model, ref_model):
                if m is not None:
                    _apply_fsdp2(m, self.device, bf16=self.use_bf16)
        self.model = model
        self.ref_model = ref_model
        self.packing = _resolve_packing(self.config.packing, model, self.device)
        if self.packing == "varlen":
            for m in (model, ref_model):
                if m is not None and _attn_impl(m) != varlen_attention.NAME:
                    m.set_attn_implementation(varlen_attention.register())
        self.pad_token_id = int(getattr(getattr(model, "config", None), "pad_token_id", None) or 0)
        self._in_sft = False
        self._build_optimizer(self.config)

    def _build_optimizer(self, schedule: TrainerConfig) -> None:
        """A fresh AdamW and LR schedule at ``schedule.lr`` (the optimizer settings always come from the config)."""
        cfg = self.config
        self.optimizer = torch.optim.AdamW(
            self._optimized_params(),
            lr=schedule.lr,
            betas=cfg.betas,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            fused=self.device.type == "cuda" or None,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_lambda(s, schedule))

    # ---------------------------------------------------------------- public steps

    def begin_sft(self, lr: float, *, warmup_steps: int = 0) -> None:
        """Following `sft_step` s use their own fresh optimizer at constant `lr` (after linear warmup)."""
        self._build_optimizer(self.config.for_sft(lr, warmup_steps=warmup_steps))
        self._in_sft = True

    def _begin_rl(self) -> None:
        """After SFT: a fresh optimizer at the configured lr, and the SFT'd policy as the KL reference."""
        self._build_optimizer(self.config)
        if self.ref_model is not None and self._ref_follows_policy:
            with torch.no_grad():
                self.ref_model.load_state_dict(self.model.state_dict())
        self._in_sft = False

    def train_step(self, batch: TrajectoryBatch) -> dict[str, float]:
        """One RL update (``num_mini_batches * ppo_epochs`` optimizer steps) on ``batch``; returns metrics."""
        t0 = time.perf_counter()
        if self._in_sft:
            self._begin_rl()
        rl = prepare_rl_step(batch, self.algorithm, self.config.temperature)
        batch, temperature = rl.batch, rl.temperature
        metrics = MetricAccumulator()
        old_lp = self._logprobs_of(self.model, batch, temperature) if rl.needs_old_logprobs else None
        ref_lp = self._logprobs_of(self.ref_model, batch, temperature) if self.ref_model is not None else None
        grad_norms, losses, lrs, lr_scales, passes = [], [], [], [], 0
        skipped_before = self.nonfinite_steps
        target = self.algorithm.loss.mismatch_kl_target
        self.model.train()
        for mini in rl.mini_batches():
            lrs.append(self.optimizer.param_groups[0]["lr"])
            self.optimizer.zero_grad(set_to_none=True)
            total = torch.zeros((), dtype=torch.float64)
            mismatch = torch.zeros(2, dtype=torch.float64)  # this mini-batch's mismatch_kl (sum, count)
            for mb in self._rank_micro_batches(batch, mini.lo, mini.hi):
                passes += 1
                if mb is None:
                    self._dummy_forward(backward=True)
                    continue
                inputs = self._loss_inputs(rl, mb[0], mb[1], old_lp, ref_lp)
                out = policy_loss(
                    inputs, self.algorithm.loss, num_tokens=mini.num_tokens, num_seqs=mini.num_seqs
                )
                self._backward(out.loss)
                total += out.loss.detach().double().cpu()
                metrics.update(out.metric_sums)
                mismatch += torch.tensor(out.metric_sums.get("mismatch_kl", (0.0, 0.0)), dtype=torch.float64)
            losses.append(float(self._all_reduce(total)))
            scale = 1.0
            if target is not None:
                kl_sum, kl_count = self._all_reduce(mismatch).tolist()
                scale = mismatch_lr_scale((kl_sum, kl_count), target)
                lr_scales.append(scale)
            grad_norms.append(self._optimizer_step(lr_scale=scale))
        result = reduce_metrics(metrics)
        if lr_scales:
            result["lr_scale"] = sum(lr_scales) / len(lr_scales)
        result.update(
            train_step_metrics(
                batch,
                adv_seq=rl.adv_seq,
                losses=losses,
                grad_norms=grad_norms,
                step=self.step,
                temperature=temperature,
                lr=lrs[-1] if lrs else self.optimizer.param_groups[0]["lr"],
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
        self.model.train()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64)
        if num_tokens > 0:
            for mb in self._rank_micro_batches(batch, 0, batch.num_sequences):
                if mb is None:
                    self._dummy_forward(backward=True)
                    continue
                start, end = mb
                lp = self._forward_logprobs(self.model, batch, start, end, 1.0)[0]
                tl, th = int(batch.cu_seqlens[start]), int(batch.cu_seqlens[end])
                out = sft_loss(lp, batch.loss_mask[tl:th].to(self.device), num_tokens=num_tokens)
                self._backward(out.loss)
                total += out.loss.detach().double().cpu()
                metrics.update(out.metric_sums)
            grad_norm = self._optimizer_step()
        else:
            grad_norm = 0.0
        result = reduce_metrics(metrics)
        result.update(
            {
                "loss": float(self._all_reduce(total)),
                "grad_norm": grad_norm,
                "lr": lr,
                "num_train_tokens": num_tokens,
                "step": float(self.step),
                "step_time_s": time.perf_counter() - t0,
            }
        )
        return result

    def compute_logprobs(self, batch: TrajectoryBatch, *, temperature: float | None = None) -> torch.Tensor:
        """Logprobs ``[T]`` of every token of ``batch`` under the policy, 0 at sequence starts.

        Under FSDP every rank computes its share and the result is all-reduced, so all ranks get all ``T``.
        """
        batch = validate_batch(batch)
        override = self.config.temperature if temperature is None else temperature
        return self._logprobs_of(self.model, batch, resolve_temperature(batch, override))

    def hf_state_dict(self, *, cpu: bool = False) -> dict[str, torch.Tensor]:
        """A snapshot of the weights under their HF names (what ``model.state_dict()`` of an unwrapped HF
        model holds): every tensor is a copy, so later optimizer steps never show through. Under bf16 these are
        the bf16 weights the model computes with (checkpoints and `save_pretrained` keep the float32 masters).

        Under FSDP the full tensors are gathered into new CPU tensors (a collective: call it on every rank;
        rank 0 gets them, the other ranks an empty dict).
        """
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        return {
            k: v.detach().to("cpu" if cpu else v.device, copy=True)
            for k, v in self.model.state_dict().items()
        }

    def save_checkpoint(
        self,
        root: str | Path,
        *,
        data_cursor: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        keep_last: int | None = None,
    ) -> Path | None:
        """Save model, optimizer, scheduler, step, RNG (all ranks) and ``data_cursor`` under ``root``.

        A collective under FSDP; rank 0 writes and returns the path, other ranks return None.
        """
        model_state = self._full_precision_state()
        optim_state = self._optimizer_state()
        rng = [capture_rng_state()]
        if self.world_size > 1:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, rng[0])
            rng = gathered
        path = None
        if self.rank == 0:
            path = save_checkpoint(
                root,
                step=self.step,
                model_state=model_state,
                optimizer_state=optim_state,
                scheduler_state=self.scheduler.state_dict(),
                data_cursor=data_cursor,
                extra=extra,
                rng_states=rng,
                keep_last=keep_last,
            )
        if self.world_size > 1:
            dist.barrier()
        return path

    def load_checkpoint(self, path: str | Path) -> Checkpoint:
        """Restore everything `save_checkpoint` wrote (``path``: a checkpoint or its root); returns it."""
        ckpt = load_checkpoint(path)
        self._load_model_state(ckpt.model)
        if ckpt.optimizer is not None:
            self._load_optimizer_state(ckpt.optimizer)
        if ckpt.scheduler is not None:
            self.scheduler.load_state_dict(ckpt.scheduler)
        self.step = ckpt.step
        if ckpt.rng:
            restore_rng_state(ckpt.rng[self.rank] if self.rank < len(ckpt.rng) else ckpt.rng[0])
        return ckpt

    def save_pretrained(self, directory: str | Path) -> None:
        """Write the policy as an ordinary HF checkpoint (``from_pretrained``-loadable); rank 0 writes."""
        sd = self._full_precision_state()
        if self.rank == 0:
            self.model.save_pretrained(str(directory), state_dict=sd)

    def _full_precision_state(self) -> dict[str, torch.Tensor]:
        """`hf_state_dict` on CPU with the float32 masters in place of the bf16 parameters they shadow."""
        sd = self.hf_state_dict(cpu=True)
        if self.masters is not None:
            for name, master in self._master_names().items():
                sd[name] = master.detach().to("cpu", copy=True)
        return sd

    def _master_names(self) -> dict[str, torch.Tensor]:
        """Every state-dict name of a parameter with a master (tied parameters have several), to its master."""
        assert self.masters is not None
        by_param = {id(p): m for p, m in zip(self.masters.params, self.masters.masters, strict=True)}
        return {
            n: by_param[id(p)]
            for n, p in self.model.named_parameters(remove_duplicate=False)
            if id(p) in by_param
        }

    # ---------------------------------------------------------------- internals

    def _rank_micro_batches(self, batch: TrajectoryBatch, lo: int, hi: int) -> list[tuple[int, int] | None]:
        """This rank's contiguous share of sequences ``[lo, hi)`` (balanced by tokens), as micro-batches.

        Under FSDP every rank must run the same number of forward/backward passes, so ranks with fewer
        micro-batches get ``None`` entries, for which a one-token dummy pass is run.
        """
        lengths = (batch.cu_seqlens[lo + 1 : hi + 1] - batch.cu_seqlens[lo:hi]).tolist()
        budget, padded = self.config.micro_batch_tokens, self.packing == "padded"
        if self.world_size == 1:
            return [(lo + s, lo + e) for s, e in plan_micro_batches(lengths, budget, padded=padded)]
        plans = []
        for r in range(self.world_size):
            a, b = token_balanced_share(lengths, r, self.world_size)
            plans.append(
                [(lo + a + s, lo + a + e) for s, e in plan_micro_batches(lengths[a:b], budget, padded=padded)]
            )
        longest = max(len(p) for p in plans)
        mine: list[tuple[int, int] | None] = list(plans[self.rank])
        return mine + [None] * (longest - len(mine))

    def _dummy_forward(self, *, backward: bool, model: nn.Module | None = None) -> None:
        """A two-token pass that contributes nothing, keeping FSDP collectives in step across ranks."""
        ids = torch.full((2,), self.pad_token_id, dtype=torch.long, device=self.device)
        cu = torch.tensor([0, 2])
        with torch.set_grad_enabled(backward):
            lp, _ = hf_token_logprobs(
                model or self.model, ids, cu, 1.0, packing=self.packing, pad_token_id=self.pad_token_id
            )
        if backward:
            self._backward(lp.sum() * 0.0)

    def _backward(self, loss: torch.Tensor) -> None:
        """Backpropagate one micro-batch's loss (scaled by the world size: FSDP averages over ranks)."""
        (loss * self.world_size).backward()
        if self.masters is not None:
            self.masters.accumulate_grads()

    @torch.no_grad()
    def _logprobs_of(self, model: nn.Module, batch: TrajectoryBatch, temperature: float) -> torch.Tensor:
        """`compute_logprobs` under `model` (the policy or the reference), on CPU, all ranks' shares merged."""
        was_training = model.training
        model.eval()
        out = torch.zeros(batch.token_ids.numel(), dtype=torch.float32)
        for mb in self._rank_micro_batches(batch, 0, batch.num_sequences):
            if mb is None:
                self._dummy_forward(backward=False, model=model)
                continue
            start, end = mb
            lp = self._forward_logprobs(model, batch, start, end, temperature)[0]
            out[int(batch.cu_seqlens[start]) : int(batch.cu_seqlens[end])] = lp.float().cpu()
        model.train(was_training)
        if self.world_size > 1:
            dist.all_reduce(out)  # ranks own disjoint token ranges, zeros elsewhere
        return out

    def _loss_inputs(
        self, rl: RLStep, start: int, end: int, old_lp: torch.Tensor | None, ref_lp: torch.Tensor | None
    ) -> LossInputs:
        lc = self.algorithm.loss
        batch = rl.batch
        want_entropy = self.config.compute_entropy or lc.entropy_coef != 0
        lp, ent, seq_index = self._forward_logprobs(
            self.model,
            batch,
            start,
            end,
            rl.temperature,
            entropy=want_entropy,
            entropy_grad=lc.entropy_coef != 0,
        )
        tl, th = int(batch.cu_seqlens[start]), int(batch.cu_seqlens[end])
        dev = self.device

        def sl(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[tl:th].to(dev)

        return LossInputs(
            logprobs=lp,
            old_logprobs=sl(old_lp) if old_lp is not None else lp.detach(),
            advantages=sl(rl.adv_tok),
            loss_mask=sl(batch.loss_mask),
            seq_index=seq_index,
            rollout_logprobs=sl(batch.rollout_logprobs),
            ref_logprobs=sl(ref_lp),
            entropy=ent,
            turn_index=sl(batch.turn_index),
        )

    def _forward_logprobs(
        self,
        model: nn.Module,
        batch: TrajectoryBatch,
        start: int,
        end: int,
        temperature: float,
        *,
        entropy: bool = False,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Forward sequences ``[start, end)``; per-token logprobs (and entropy), packed order, on device."""
        cu = batch.cu_seqlens[start : end + 1] - batch.cu_seqlens[start]
        tl, th = int(batch.cu_seqlens[start]), int(batch.cu_seqlens[end])
        ids = batch.token_ids[tl:th].to(self.device)
        lp, ent = hf_token_logprobs(
            model,
            ids,
            cu,
            temperature,
            packing=self.packing,
            pad_token_id=self.pad_token_id,
            entropy=entropy,
            kept_counts=replayed_kept_counts(batch, self.config.sampling_mask, tl, th, self.device),
        )
        if ent is not None and not entropy_grad:
            ent = ent.detach()
        lengths = (cu[1:] - cu[:-1]).to(self.device)
        seq_index = torch.repeat_interleave(torch.arange(lengths.numel(), device=self.device), lengths)
        return lp, ent, seq_index

    def _optimized_params(self) -> list[torch.Tensor]:
        """What the optimizer steps: the float32 masters under bf16 in one process, else the trainable parameters."""
        if self.masters is not None:
            return list(self.masters.masters)
        return [p for p in self.model.parameters() if p.requires_grad]

    def _optimizer_step(self, *, lr_scale: float = 1.0) -> float:
        """Clip, step at ``lr_scale`` times the scheduled learning rate (`mismatch_lr_scale`), advance the
        schedule; returns the gradient norm."""
        params = self._optimized_params()
        if self.config.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        if math.isfinite(float(norm)):  # the same total norm on every rank: all skip, or none
            scheduled = [group["lr"] for group in self.optimizer.param_groups]
            if lr_scale != 1.0:
                for group, lr in zip(self.optimizer.param_groups, scheduled, strict=True):
                    group["lr"] = lr * lr_scale
            self.optimizer.step()
            for group, lr in zip(self.optimizer.param_groups, scheduled, strict=True):
                group["lr"] = lr
            self.scheduler.step()
            if self.masters is not None:
                self.masters.copy_to_model()
        else:  # a NaN or inf gradient would poison every weight: skip the update (the schedule counts updates)
            self.nonfinite_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(norm)

    def _all_reduce(self, value: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            value = value.to(torch.float64)
            dist.all_reduce(value)
        return value

    def _optimizer_state(self) -> dict[str, Any]:
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            return get_optimizer_state_dict(
                self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        return self.optimizer.state_dict()

    def _load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        try:
            if self.fsdp:
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

                set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))
            else:
                self.model.load_state_dict(state, strict=True)
                if self.masters is not None:
                    values = {id(m): state[n] for n, m in self._master_names().items()}
                    self.masters.load([values[id(m)].to(m.device) for m in self.masters.masters])
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(f"checkpoint weights do not fit this model: {e}") from e

    def _load_optimizer_state(self, state: dict[str, Any]) -> None:
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(
                self.model, self.optimizer, state, options=StateDictOptions(full_state_dict=True)
            )
        else:
            self.optimizer.load_state_dict(state)


# -------------------------------------------------------------------- helpers


#: Model families whose causal-LM logits are exactly ``lm_head(final hidden states)`` (no soft-capping or
#: scaling after the head): for these the head is applied chunk by chunk by `token_logprobs_from_hidden`.
FUSED_HEAD_FAMILIES: frozenset[str] = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"}
)


def fused_lm_head(model: nn.Module) -> nn.Linear | None:
    """The LM head of `model` (an HF causal LM, or a peft model around one) when its logits are a plain
    bias-free linear map of the final hidden states of a `FUSED_HEAD_FAMILIES` model, else None."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    family = getattr(getattr(inner, "config", None), "model_type", None)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if family in FUSED_HEAD_FAMILIES and type(head) is nn.Linear and head.bias is None:
        return head
    return None


def hf_token_logprobs(
    model: nn.Module,
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    temperature: float,
    *,
    packing: str = "padded",
    pad_token_id: int = 0,
    entropy: bool = False,
    kept_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward packed sequences through an HF causal LM; each token's logprob (and entropy) in packed order.

    ``token_ids``: ``[T]`` (on the model's device), the sequences back to back; ``cu_seqlens``: ``[n + 1]``
    their boundaries. ``packing`` lays them out for the model: ``padded`` (right-padded rows with an attention
    mask), ``packed`` (one row, position ids restarting per sequence) or ``varlen`` (one row, per-sequence
    attention through `miles.learner.varlen_attention`, when the model uses it). Conventions as
    `shifted_token_logprobs`: sequence starts get 0, values in float32, at ``temperature``.

    For `fused_lm_head` models the head never runs over the full batch: the final hidden states of the real
    (unpadded) tokens go through `token_logprobs_from_hidden`, so the ``[T, V]`` logits are never materialised.
    Gradients flow as through the plain forward (entropy included). ``kept_counts`` (``[T]``, on the model's
    device) renormalise each token's distribution over its sampler's kept set (sampling-mask replay,
    `miles.learner.logprobs`).
    """
    device = token_ids.device
    cu = cu_seqlens.to(device)
    lengths = cu[1:] - cu[:-1]
    n_seq = lengths.numel()
    seq_index = torch.repeat_interleave(torch.arange(n_seq, device=device), lengths)
    starts = cu[:-1]
    positions = torch.arange(token_ids.numel(), device=device) - starts[seq_index]
    host_lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    longest = max(host_lengths)
    kwargs: dict[str, Any] = {"use_cache": False}
    if packing == "padded":
        ids = torch.full((n_seq, longest), pad_token_id, dtype=token_ids.dtype, device=device)
        attn = torch.zeros((n_seq, longest), dtype=torch.long, device=device)
        ids[seq_index, positions] = token_ids
        attn[seq_index, positions] = 1
        kwargs.update(input_ids=ids, attention_mask=attn)
    else:
        kwargs.update(input_ids=token_ids.unsqueeze(0), position_ids=positions.unsqueeze(0))
        if packing == "varlen" and _attn_impl(model) == varlen_attention.NAME:
            mask_map = varlen_attention.no_mask_mapping(model)
            kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
            if mask_map is not None:
                kwargs["attention_mask"] = mask_map

    def unpad(rows: torch.Tensor) -> torch.Tensor:
        return rows[seq_index, positions] if packing == "padded" else rows[0]

    head = fused_lm_head(model)
    if head is None:
        logits = unpad(model(**kwargs).logits)
        lp = shifted_token_logprobs(logits, token_ids, starts, temperature, kept_counts)
        ent = shifted_entropy(logits, starts, temperature, kept_counts, token_ids) if entropy else None
        return lp, ent
    with lm_head_bypassed(head) as captured:
        model(**kwargs)
    return token_logprobs_from_hidden(
        unpad(captured[0]),
        head.weight,
        token_ids,
        starts,
        temperature,
        entropy=entropy,
        kept_counts=kept_counts,
    )


def _params_to_bf16(model: nn.Module) -> None:
    """Parameters to bf16 in place (buffers such as RoPE frequencies stay float32, as HF loads them in bf16)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(torch.bfloat16)


def _apply_fsdp2(model: nn.Module, device: torch.device, *, bf16: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in no_split:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def _attn_impl(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "_attn_implementation", "") or "")


def _resolve_packing(packing: str, model: nn.Module, device: torch.device) -> str:
    """`auto`: on a CPU ``varlen`` (no padding outside attention; measured in docs/benchmarks.md on the main
    job's batch: 0.7x the time of ``padded``), for models that take a custom attention function; on a GPU
    ``padded`` micro-batches (SDPA's fast causal kernels, measured there before ``varlen`` got its one-call
    attention). ``packed`` (one row, a block-diagonal mask over it) is never chosen: its attention is quadratic
    in the packed length.
    """
    if packing != "auto":
        return packing
    if device.type == "cpu" and getattr(model, "_supports_attention_backend", False):
        return "varlen"
    return "padded"


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            idx = dist.get_rank() % torch.cuda.device_count() if dist.is_initialized() else 0
            return torch.device("cuda", idx)
        return torch.device("cpu")
    return torch.device(name)
