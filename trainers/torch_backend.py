"""`TorchTrainer`: GRPO/PPO and SFT steps for any HF causal LM on CPU or CUDA, FSDP2 when distributed.

Sequences are packed padding-free into micro-batches of at most ``micro_batch_tokens`` tokens: one row of
concatenated sequences whose ``position_ids`` restart at 0 for each sequence. Packing modes:

- ``packed`` (the ``auto`` choice for sdpa/eager/flash models): position ids only; transformers (>= 4.54)
  turns them into varlen flash calls, or for sdpa into a block-diagonal ``L x L`` mask (correct, but
  quadratic in the packed length);
- ``varlen``: the model's attention is switched to `miles.trainers.varlen_attention` (per-sequence causal
  SDPA; plain sdpa everywhere else), so no cross-sequence attention and no ``L x L`` mask;
- ``padded``: right-padded micro-batches with an attention mask (the fallback for other models).

With a world size above 1 every rank calls `train_step` with the same full batch; the trainer computes
advantages on the whole batch (groups may span ranks), takes its own share of the sequences, and
normalizes the loss by batch-global token/sequence counts so the update equals the single-process one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from miles.trajectory import TrajectoryBatch

from . import varlen_attention
from .advantages import AdvantageConfig, batch_advantages
from .checkpoint import (
    Checkpoint,
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from .errors import CheckpointError, ConfigError
from .logprobs import shifted_entropy, shifted_token_logprobs
from .losses import LossConfig, LossInputs, policy_loss, sft_loss
from .metrics import MetricAccumulator, train_step_metrics

Schedule = Literal["constant", "cosine", "linear"]
Packing = Literal["auto", "varlen", "packed", "padded"]
Precision = Literal["auto", "bf16", "fp32"]


@dataclass(frozen=True)
class AlgorithmConfig:
    """Advantage estimator plus policy loss, and how many optimizer steps one batch gives."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    num_mini_batches: int = 1
    ppo_epochs: int = 1

    def __post_init__(self) -> None:
        if self.num_mini_batches < 1:
            raise ConfigError("num_mini_batches", f"must be >= 1, got {self.num_mini_batches}")
        if self.ppo_epochs < 1:
            raise ConfigError("ppo_epochs", f"must be >= 1, got {self.ppo_epochs}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AlgorithmConfig:
        """Build from plain dicts (``{"advantage": {...}, "loss": {...}, ...}``); unknown keys raise ConfigError."""
        data = dict(data)
        adv = _build(AdvantageConfig, data.pop("advantage", {}) or {}, "algorithm.advantage")
        loss_d = dict(data.pop("loss", {}) or {})
        if loss_d.get("icepop") is not None:
            loss_d["icepop"] = tuple(loss_d["icepop"])
        loss = _build(LossConfig, loss_d, "algorithm.loss")
        return _build(cls, {**data, "advantage": adv, "loss": loss}, "algorithm")


@dataclass(frozen=True)
class TorchTrainerConfig:
    """Optimizer, schedule, batching and precision settings of `TorchTrainer`.

    ``temperature=None`` takes the rollout temperature from the batch's ``meta[i]["sampling_params"]``
    (1.0 when absent); logprobs are always recomputed as ``log_softmax(logits / T)``.
    ``total_steps`` is needed by the ``cosine`` and ``linear`` schedules (decay to ``min_lr_ratio * lr``).
    """

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    lr_schedule: Schedule = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    micro_batch_tokens: int = 4096
    temperature: float | None = None
    packing: Packing = "auto"
    precision: Precision = "auto"
    compute_entropy: bool = True
    gradient_checkpointing: bool = False
    device: str = "auto"

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError("lr", f"must be > 0, got {self.lr}")
        if self.lr_schedule not in ("constant", "cosine", "linear"):
            raise ConfigError("lr_schedule", f"must be constant|cosine|linear, got {self.lr_schedule!r}")
        if self.lr_schedule != "constant" and not (self.total_steps and self.total_steps > 0):
            raise ConfigError("total_steps", f"the {self.lr_schedule} schedule needs total_steps > 0")
        if self.warmup_steps < 0:
            raise ConfigError("warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if self.micro_batch_tokens < 1:
            raise ConfigError("micro_batch_tokens", f"must be >= 1, got {self.micro_batch_tokens}")
        if self.temperature is not None and not self.temperature > 0:
            raise ConfigError("temperature", f"must be > 0, got {self.temperature}")
        if self.packing not in ("auto", "varlen", "packed", "padded"):
            raise ConfigError("packing", f"must be auto|varlen|packed|padded, got {self.packing!r}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ConfigError("precision", f"must be auto|bf16|fp32, got {self.precision!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError("max_grad_norm", f"must be > 0 or null, got {self.max_grad_norm}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TorchTrainerConfig:
        d = dict(data)
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return _build(cls, d, "trainer")


def lr_lambda(step: int, config: TorchTrainerConfig) -> float:
    """LR multiplier after ``step`` optimizer steps: linear warmup, then constant / cosine / linear decay."""
    if config.warmup_steps and step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return 1.0
    total = max(config.total_steps - config.warmup_steps, 1)  # type: ignore[operator]
    progress = min(max(step - config.warmup_steps, 0) / total, 1.0)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if config.lr_schedule == "cosine" else 1 - progress
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * shape


def plan_micro_batches(lengths: list[int], token_budget: int, *, padded: bool = False) -> list[tuple[int, int]]:
    """Split sequences (in order) into contiguous ``[start, end)`` ranges of at most ``token_budget`` tokens.

    With ``padded=True`` a range costs ``count * longest`` (what a right-padded micro-batch holds).
    A sequence longer than the budget gets a micro-batch of its own.
    """
    plans: list[tuple[int, int]] = []
    start, used, longest = 0, 0, 0
    for i, n in enumerate(lengths):
        cost = (i - start + 1) * max(longest, n) if padded else used + n
        if i > start and cost > token_budget:
            plans.append((start, i))
            start, used, longest = i, 0, 0
        used += n
        longest = max(longest, n)
    if start < len(lengths):
        plans.append((start, len(lengths)))
    return plans


class TorchTrainer:
    """Trains an HF causal LM on `TrajectoryBatch` es.

    ``model`` is any ``transformers`` causal LM (``model(input_ids, position_ids=...) -> .logits``).
    ``ref_model`` (optional, frozen) provides reference logprobs for the KL penalty/metric.
    When ``torch.distributed`` is initialized with world size > 1 the model is wrapped with FSDP2
    (``fully_shard`` on every no-split decoder layer, then on the root).
    """

    def __init__(self, model: nn.Module, config: TorchTrainerConfig | None = None,
                 algorithm: AlgorithmConfig | None = None, *, ref_model: nn.Module | None = None) -> None:
        self.config = config or TorchTrainerConfig()
        self.algorithm = algorithm or AlgorithmConfig()
        self.device = _resolve_device(self.config.device)
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world_size > 1 else 0
        self.use_bf16 = self.config.precision == "bf16" or (
            self.config.precision == "auto" and self.device.type == "cuda")
        self.step = 0
        model.to(self.device)
        if self.config.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable()
        self.fsdp = self.world_size > 1
        if self.fsdp:
            _apply_fsdp2(model, self.device)
        self.model = model
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.to(self.device).eval().requires_grad_(False)
        self.packing = _resolve_packing(self.config.packing, model, self.device)
        if self.packing == "varlen":
            for m in (model, ref_model):
                if m is not None and _attn_impl(m) != varlen_attention.NAME:
                    m.set_attn_implementation(varlen_attention.register())
        self.pad_token_id = int(getattr(getattr(model, "config", None), "pad_token_id", None) or 0)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=self.config.lr, betas=self.config.betas,
                                           eps=self.config.adam_eps, weight_decay=self.config.weight_decay,
                                           fused=self.device.type == "cuda" or None)
        cfg = self.config
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_lambda(s, cfg))

    # ---------------------------------------------------------------- public steps

    def train_step(self, batch: TrajectoryBatch) -> dict[str, float]:
        """One RL update (``num_mini_batches * ppo_epochs`` optimizer steps) on ``batch``; returns metrics."""
        t0 = time.perf_counter()
        alg = self.algorithm
        batch = _validate(batch)
        temperature = self._temperature(batch)
        mask = batch.loss_mask
        token_counts, adv_seq, adv_tok = batch_advantages(batch, alg.advantage)
        metrics = MetricAccumulator()
        multi_step = alg.num_mini_batches > 1 or alg.ppo_epochs > 1
        old_lp = self.compute_logprobs(batch, temperature=temperature) if multi_step else None
        ref_lp = None
        if self.ref_model is not None:
            ref_lp = self.compute_logprobs(batch, temperature=temperature, model=self.ref_model)
        elif alg.loss.kl_coef > 0:
            raise ConfigError("algorithm.loss.kl_coef", "kl_coef > 0 needs a ref_model")
        minis = _split_even(batch.num_sequences, alg.num_mini_batches)
        grad_norms, losses, lrs = [], [], []
        self.model.train()
        for _ in range(alg.ppo_epochs):
            for lo, hi in minis:
                tok_lo, tok_hi = int(batch.cu_seqlens[lo]), int(batch.cu_seqlens[hi])
                num_tokens = float(mask[tok_lo:tok_hi].sum())
                num_seqs = float((token_counts[lo:hi] > 0).sum())
                if num_tokens == 0:
                    continue
                lrs.append(self.optimizer.param_groups[0]["lr"])
                self.optimizer.zero_grad(set_to_none=True)
                total = torch.zeros((), dtype=torch.float64)
                for mb in self._rank_micro_batches(batch, lo, hi):
                    if mb is None:
                        self._dummy_forward(backward=True)
                        continue
                    inputs = self._loss_inputs(batch, mb[0], mb[1], temperature, adv_tok, old_lp, ref_lp)
                    out = policy_loss(inputs, alg.loss, num_tokens=num_tokens, num_seqs=num_seqs)
                    (out.loss * self.world_size).backward()
                    total += out.loss.detach().double().cpu()
                    metrics.update(out.metric_sums)
                losses.append(float(self._all_reduce(total)))
                grad_norms.append(self._optimizer_step())
        result = self._reduce_metrics(metrics)
        result.update(train_step_metrics(
            batch, adv_seq=adv_seq, losses=losses, grad_norms=grad_norms, step=self.step, temperature=temperature,
            lr=lrs[-1] if lrs else self.optimizer.param_groups[0]["lr"], t0=t0))
        return result

    def sft_step(self, batch: TrajectoryBatch) -> dict[str, float]:
        """One supervised step: token-mean cross-entropy on loss-masked tokens (temperature 1)."""
        t0 = time.perf_counter()
        batch = _validate(batch)
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
                (out.loss * self.world_size).backward()
                total += out.loss.detach().double().cpu()
                metrics.update(out.metric_sums)
            grad_norm = self._optimizer_step()
        else:
            grad_norm = 0.0
        result = self._reduce_metrics(metrics)
        result.update({"loss": float(self._all_reduce(total)), "grad_norm": grad_norm, "lr": lr,
                       "num_train_tokens": num_tokens, "step": float(self.step),
                       "step_time_s": time.perf_counter() - t0})
        return result

    @torch.no_grad()
    def compute_logprobs(self, batch: TrajectoryBatch, *, temperature: float | None = None,
                         model: nn.Module | None = None) -> torch.Tensor:
        """Logprobs ``[T]`` of every token of ``batch`` under ``model`` (default: the policy), 0 at sequence starts.

        Under FSDP every rank computes its share and the result is all-gathered, so all ranks get all ``T``.
        """
        model = model or self.model
        batch = _validate(batch)
        temperature = self._temperature(batch) if temperature is None else temperature
        was_training = model.training
        model.eval()
        out = torch.zeros(batch.token_ids.numel(), dtype=torch.float32)
        for mb in self._rank_micro_batches(batch, 0, batch.num_sequences):
            if mb is None:
                self._dummy_forward(backward=False, model=model)
                continue
            start, end = mb
            lp = self._forward_logprobs(model, batch, start, end, temperature)[0]
            out[int(batch.cu_seqlens[start]):int(batch.cu_seqlens[end])] = lp.float().cpu()
        model.train(was_training)
        if self.world_size > 1:
            dist.all_reduce(out)  # ranks own disjoint token ranges, zeros elsewhere
        return out

    def hf_state_dict(self, *, cpu: bool = False) -> dict[str, torch.Tensor]:
        """Weights under their HF names (what ``model.state_dict()`` of an unwrapped HF model holds).

        Without FSDP the tensors are the live parameters (detached, not copied) unless ``cpu=True``.
        Under FSDP the full tensors are gathered (a collective: call it on every rank) and offloaded to CPU.
        """
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                             cpu_offload=True))
        sd = {k: v.detach() for k, v in self.model.state_dict().items()}
        return {k: v.cpu() for k, v in sd.items()} if cpu else sd

    def save_checkpoint(self, root: str | Path, *, data_cursor: dict[str, Any] | None = None,
                        extra: dict[str, Any] | None = None, keep_last: int | None = None) -> Path | None:
        """Save model, optimizer, scheduler, step, RNG (all ranks) and ``data_cursor`` under ``root``.

        A collective under FSDP; rank 0 writes and returns the path, other ranks return None.
        """
        model_state = self.hf_state_dict(cpu=True)
        optim_state = self._optimizer_state()
        rng = [capture_rng_state()]
        if self.world_size > 1:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, rng[0])
            rng = gathered
        path = None
        if self.rank == 0:
            path = save_checkpoint(root, step=self.step, model_state=model_state, optimizer_state=optim_state,
                                   scheduler_state=self.scheduler.state_dict(), data_cursor=data_cursor,
                                   extra=extra, rng_states=rng, keep_last=keep_last)
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
        sd = self.hf_state_dict(cpu=True)
        if self.rank == 0:
            self.model.save_pretrained(str(directory), state_dict=sd)

    # ---------------------------------------------------------------- internals

    def _temperature(self, batch: TrajectoryBatch) -> float:
        if self.config.temperature is not None:
            return float(self.config.temperature)
        temps = {float(m.get("sampling_params", {}).get("temperature", 1.0) or 1.0) for m in batch.meta}
        if len(temps) > 1:
            raise ValueError(f"batch mixes rollout temperatures {sorted(temps)}; set trainer.temperature")
        return temps.pop() if temps else 1.0

    def _rank_micro_batches(self, batch: TrajectoryBatch, lo: int, hi: int) -> list[tuple[int, int] | None]:
        """This rank's contiguous share of sequences ``[lo, hi)`` (balanced by tokens), as micro-batches.

        Under FSDP every rank must run the same number of forward/backward passes, so ranks with fewer
        micro-batches get ``None`` entries, for which a one-token dummy pass is run.
        """
        lengths = (batch.cu_seqlens[lo + 1:hi + 1] - batch.cu_seqlens[lo:hi]).tolist()
        budget, padded = self.config.micro_batch_tokens, self.packing == "padded"
        if self.world_size == 1:
            return [(lo + s, lo + e) for s, e in plan_micro_batches(lengths, budget, padded=padded)]
        plans = []
        for r in range(self.world_size):
            a, b = _token_balanced_share(lengths, r, self.world_size)
            plans.append([(lo + a + s, lo + a + e)
                          for s, e in plan_micro_batches(lengths[a:b], budget, padded=padded)])
        longest = max(len(p) for p in plans)
        mine: list[tuple[int, int] | None] = list(plans[self.rank])
        return mine + [None] * (longest - len(mine))

    def _dummy_forward(self, *, backward: bool, model: nn.Module | None = None) -> None:
        """A one-token pass that contributes nothing, keeping FSDP collectives in step across ranks."""
        model = model or self.model
        ids = torch.full((1, 1), self.pad_token_id, dtype=torch.long, device=self.device)
        with torch.set_grad_enabled(backward), self._autocast():
            logits = model(input_ids=ids, use_cache=False).logits
        if backward:
            (logits.float().sum() * 0.0).backward()

    def _loss_inputs(self, batch: TrajectoryBatch, start: int, end: int, temperature: float,
                     adv_tok: torch.Tensor, old_lp: torch.Tensor | None,
                     ref_lp: torch.Tensor | None) -> LossInputs:
        lc = self.algorithm.loss
        want_entropy = self.config.compute_entropy or lc.entropy_coef != 0
        lp, ent, seq_index = self._forward_logprobs(self.model, batch, start, end, temperature,
                                                    entropy=want_entropy, entropy_grad=lc.entropy_coef != 0)
        tl, th = int(batch.cu_seqlens[start]), int(batch.cu_seqlens[end])
        dev = self.device

        def sl(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[tl:th].to(dev)

        return LossInputs(
            logprobs=lp, old_logprobs=sl(old_lp) if old_lp is not None else lp.detach(),
            advantages=sl(adv_tok), loss_mask=sl(batch.loss_mask), seq_index=seq_index,
            rollout_logprobs=sl(batch.rollout_logprobs), ref_logprobs=sl(ref_lp), entropy=ent)

    def _forward_logprobs(self, model: nn.Module, batch: TrajectoryBatch, start: int, end: int,
                          temperature: float, *, entropy: bool = False, entropy_grad: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Forward sequences ``[start, end)``; per-token logprobs (and entropy), packed order, on device."""
        cu = batch.cu_seqlens[start:end + 1] - batch.cu_seqlens[start]
        tl, th = int(batch.cu_seqlens[start]), int(batch.cu_seqlens[end])
        ids = batch.token_ids[tl:th].to(self.device)
        lengths = (cu[1:] - cu[:-1]).to(self.device)
        n_seq = lengths.numel()
        seq_index = torch.repeat_interleave(torch.arange(n_seq, device=self.device), lengths)
        starts = cu[:-1].to(self.device)
        positions = torch.arange(ids.numel(), device=self.device) - starts[seq_index]
        with self._autocast():
            if self.packing == "varlen" and _attn_impl(model) == varlen_attention.NAME:
                cu_dev = cu.to(self.device)
                longest = int(lengths.max())
                mask_map = varlen_attention.no_mask_mapping(model)
                extra = {} if mask_map is None else {"attention_mask": mask_map}
                logits = model(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False,
                               cu_seq_lens_q=cu_dev, cu_seq_lens_k=cu_dev, max_length_q=longest,
                               max_length_k=longest, **extra).logits[0]
            elif self.packing in ("packed", "varlen"):
                logits = model(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                               use_cache=False).logits[0]
            else:
                max_len = int(lengths.max())
                padded = torch.full((n_seq, max_len), self.pad_token_id, dtype=ids.dtype, device=self.device)
                attn = torch.zeros((n_seq, max_len), dtype=torch.long, device=self.device)
                padded[seq_index, positions] = ids
                attn[seq_index, positions] = 1
                logits = model(input_ids=padded, attention_mask=attn, use_cache=False).logits
                logits = logits[seq_index, positions]
        lp = shifted_token_logprobs(logits, ids, starts, temperature)
        ent = None
        if entropy:
            if entropy_grad:
                ent = shifted_entropy(logits, starts, temperature)
            else:
                with torch.no_grad():
                    ent = shifted_entropy(logits.detach(), starts, temperature)
        return lp, ent, seq_index

    def _autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.use_bf16)

    def _optimizer_step(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.config.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(norm)

    def _all_reduce(self, value: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            value = value.to(torch.float64)
            dist.all_reduce(value)
        return value

    def _reduce_metrics(self, acc: MetricAccumulator) -> dict[str, float]:
        if self.world_size == 1:
            return acc.result()
        names = sorted(acc._sums)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, {n: (acc._sums[n], acc._counts[n]) for n in names})
        merged = MetricAccumulator()
        for part in gathered:
            merged.update(part)
        return merged.result()

    def _optimizer_state(self) -> dict[str, Any]:
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            return get_optimizer_state_dict(self.model, self.optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return self.optimizer.state_dict()

    def _load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        try:
            if self.fsdp:
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

                set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))
            else:
                self.model.load_state_dict(state, strict=True)
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(f"checkpoint weights do not fit this model: {e}") from e

    def _load_optimizer_state(self, state: dict[str, Any]) -> None:
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.model, self.optimizer, state,
                                     options=StateDictOptions(full_state_dict=True))
        else:
            self.optimizer.load_state_dict(state)


# -------------------------------------------------------------------- helpers


def _apply_fsdp2(model: nn.Module, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in no_split:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _attn_impl(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "_attn_implementation", "") or "")


def _resolve_packing(packing: str, model: nn.Module, device: torch.device) -> str:
    """`auto` is padded micro-batches: a packed row's block-diagonal mask costs attention over the whole row
    and keeps SDPA off its fast causal kernels. Measured (docs/benchmarks.md): H200, 0.5B, 4 x 2k tokens:
    padded 0.122 s/step, varlen 0.144, packed 0.188; CPU, tiny 1m, 64 x ~200 tokens: padded 4.2 s, packed 12.3.
    """
    del model, device
    return "padded" if packing == "auto" else packing


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            idx = dist.get_rank() % torch.cuda.device_count() if dist.is_initialized() else 0
            return torch.device("cuda", idx)
        return torch.device("cpu")
    return torch.device(name)


def _validate(batch: TrajectoryBatch) -> TrajectoryBatch:
    t = batch.token_ids.numel()
    if batch.loss_mask.numel() != t or batch.rollout_logprobs.numel() != t:
        raise ValueError(f"batch tensors disagree: token_ids={t} loss_mask={batch.loss_mask.numel()} "
                         f"rollout_logprobs={batch.rollout_logprobs.numel()}")
    if batch.cu_seqlens.numel() < 1 or int(batch.cu_seqlens[-1]) != t or int(batch.cu_seqlens[0]) != 0:
        raise ValueError(f"cu_seqlens must run from 0 to {t}, got {batch.cu_seqlens.tolist()}")
    if bool((batch.cu_seqlens[1:] <= batch.cu_seqlens[:-1]).any()):
        raise ValueError("every sequence of the batch must have at least one token")
    if batch.rewards.numel() != batch.num_sequences or batch.group_ids.numel() != batch.num_sequences:
        raise ValueError("rewards and group_ids need one entry per sequence")
    return batch


def _split_even(n: int, parts: int) -> list[tuple[int, int]]:
    parts = max(1, min(parts, n)) if n else 1
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts) if bounds[i + 1] > bounds[i]]


def _token_balanced_share(lengths: list[int], rank: int, world: int) -> tuple[int, int]:
    """Contiguous ``[a, b)`` of ``lengths`` for ``rank``, cutting where the cumulative token count crosses k/world."""
    total = sum(lengths)
    cuts, acc, j = [0], 0, 1
    for i, n in enumerate(lengths):
        acc += n
        while j < world and acc >= total * j / world:
            cuts.append(i + 1)
            j += 1
    while len(cuts) < world + 1:
        cuts.append(len(lengths))
    return cuts[rank], cuts[rank + 1]


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    names = set(cls.__dataclass_fields__)
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{prefix}.{unknown[0]}", f"unknown key; valid keys: {sorted(names)}")
    try:
        return cls(**data)
    except ConfigError as e:
        raise ConfigError(f"{prefix}.{e.key}", e.message) from e
    except TypeError as e:
        raise ConfigError(prefix, str(e)) from e

