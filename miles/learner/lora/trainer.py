"""`MultiLoraTrainer`: several LoRA adapters (peft) on one frozen base model, trained in the same steps.

The base weights are held once; every adapter lives in the same `peft.PeftModel`. Each adapter has its own
`TorchTrainer` over that model (its own AdamW, LR schedule and optimizer-step count), built and driven while
peft has that adapter active, so that its optimizer holds exactly its own parameters. A step splits the batch
by `policy_id` and gives each adapter its own sequences: advantages, loss normalisation, gradient clipping
and the optimizer step all see only that adapter's groups. So gradients of one adapter never touch another,
and an adapter's update does not depend on which other adapters share the step: trained beside others, it
ends with the weights it would have had trained alone on the same groups (`tests/learner/lora/test_trainer.py`).
"""

from __future__ import annotations

import contextlib
import copy
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles.engine import BASE_POLICY
from miles.engines.lora import AdapterWeights, check_adapter_name
from miles.learner.checkpoint import (
    Checkpoint,
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from miles.learner.config import (
    AlgorithmConfig,
    TorchOptions,
    TorchTrainerConfig,
    TrainerConfig,
    merge,
)
from miles.learner.errors import CheckpointError, ConfigError
from miles.learner.lora.config import LoraSpec, adapter_trainer_config
from miles.learner.step import validate_batch
from miles.learner.torch_backend import TorchTrainer
from miles.trajectory import TrajectoryBatch

ADAPTERS_DIR = (
    "adapters"  # PEFT folders of every adapter, inside each checkpoint and `save_pretrained` folder
)


@dataclass(frozen=True)
class AdapterSpec:
    """What the trainer needs of one adapter: its name, LoRA shape, optimizer settings (lr and schedule) and the
    seed of its initialisation (the same seed gives the same initial adapter, alone or beside others)."""

    name: str
    lora: LoraSpec = LoraSpec()
    trainer: TrainerConfig = TrainerConfig()
    seed: int = 0


def default_seed(run_seed: int, name: str) -> int:
    """An adapter's init seed when its config sets none: stable across runs, different per name."""
    return (run_seed * 1_000_003 + zlib.crc32(name.encode())) % 2**31


class MultiLoraTrainer:
    """Trains the LoRA adapters `adapters` on `model` (an HF causal LM whose weights stay frozen); implements
    `miles.learner.protocol.Trainer` over batches whose sequences carry their adapter's name as `policy_id`.

    `hf_state_dict` is the base model's weights (what engines start from); `adapter_weights(name)` an adapter's,
    in PEFT's layout. `last_trained` names the adapters the latest `train_step` updated (what to sync).
    With ``algorithm.loss.kl_coef > 0`` the KL reference is the base model (one frozen copy for all adapters).
    """

    def __init__(
        self,
        model: nn.Module,
        adapters: Sequence[AdapterSpec],
        options: TorchOptions | None = None,
        algorithm: AlgorithmConfig | None = None,
        *,
        base_model: str = "",
    ) -> None:
        from peft import LoraConfig, get_peft_model

        if not adapters:
            raise ValueError("MultiLoraTrainer needs at least one adapter")
        names = [check_adapter_name(a.name) for a in adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"adapter names must differ, got {names}")
        self.algorithm = algorithm or AlgorithmConfig()
        self.specs = {a.name: a for a in adapters}
        self.base_model = base_model
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        for a in adapters:
            missing = sorted(set(a.lora.target_modules) - set(linear))
            if missing:
                raise ConfigError(
                    f"adapters[{a.name}].lora.target_modules",
                    f"the model has no linear layer named {missing}; its linear layers are {linear}",
                )
        reference = copy.deepcopy(model) if self.algorithm.needs_reference else None
        peft_model: Any = None
        for a in adapters:
            lora = LoraConfig(
                r=a.lora.rank,
                lora_alpha=a.lora.alpha,
                lora_dropout=a.lora.dropout,
                target_modules=list(a.lora.target_modules),
                bias="none",
                task_type="CAUSAL_LM",
            )
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(a.seed)
                try:
                    if peft_model is None:
                        peft_model = get_peft_model(model, lora, adapter_name=a.name)
                    else:
                        peft_model.add_adapter(a.name, lora)
                except ValueError as exc:
                    raise ConfigError(
                        f"adapters[{a.name}].lora.target_modules", str(exc).splitlines()[0]
                    ) from exc
        self.model = peft_model
        self.trainers: dict[str, TorchTrainer] = {}
        for a in adapters:
            with self._active(
                a.name
            ):  # the optimizer takes the parameters peft made trainable: this adapter's
                self.trainers[a.name] = TorchTrainer(
                    peft_model,
                    merge(TorchTrainerConfig, a.trainer, options or TorchOptions()),
                    self.algorithm,
                    ref_model=reference,
                )
        self.step = 0
        self.last_trained: tuple[str, ...] = ()

    @property
    def names(self) -> list[str]:
        return list(self.trainers)

    @contextlib.contextmanager
    def _active(self, name: str) -> Iterator[None]:
        self.model.set_adapter(name)  # only `name`'s LoRA layers compute and require grad
        yield

    def _by_policy(self, batch: TrajectoryBatch, *, allow_base: bool = False) -> dict[str, list[int]]:
        """Sequence indices per policy, in the order the adapters were configured."""
        groups: dict[str, list[int]] = {}
        for i in range(batch.num_sequences):
            groups.setdefault(batch.policy_of(i), []).append(i)
        unknown = sorted(set(groups) - set(self.trainers) - ({BASE_POLICY} if allow_base else set()))
        if unknown:
            raise ValueError(
                f"the batch holds sequences of policies {unknown}, which are not adapters of this "
                f"trainer ({self.names}); the frozen base cannot be trained"
            )
        order = [BASE_POLICY, *self.trainers]
        return {name: groups[name] for name in order if name in groups}

    @staticmethod
    def _part(batch: TrajectoryBatch, indices: list[int]) -> TrajectoryBatch:
        return batch if indices == list(range(batch.num_sequences)) else batch.select(indices)

    # ---------------------------------------------------------------- Trainer protocol
    def train_step(self, batch: TrajectoryBatch) -> dict[str, float]:
        """One RL update of every adapter with sequences in `batch`, each on its own sequences only. Metrics
        are `NAME/<metric>` per adapter, plus the step's `num_tokens`, `num_sequences`, `adapters_trained`,
        `step` and `step_time_s`."""
        t0 = time.perf_counter()
        validate_batch(batch)
        groups = self._by_policy(batch)
        metrics: dict[str, float] = {}
        for name, indices in groups.items():
            metrics.update(self.train_adapter(name, self._part(batch, indices)))
        metrics.update(self.end_step(tuple(groups)))
        metrics.update(
            num_tokens=float(batch.token_ids.numel()),
            num_sequences=float(batch.num_sequences),
            step_time_s=time.perf_counter() - t0,
        )
        return metrics

    def train_adapter(self, name: str, batch: TrajectoryBatch) -> dict[str, float]:
        """One RL update of adapter `name` alone, on `batch` (all of its sequences must be `name`'s); metrics
        as `NAME/<metric>`. A step made of such updates ends with `end_step`."""
        if set(self._by_policy(validate_batch(batch))) != {name}:
            raise ValueError(f"train_adapter({name!r}) got sequences of other policies")
        with self._active(name):
            result = self.trainers[name].train_step(batch)
        return {f"{name}/{k}": v for k, v in result.items()}

    def end_step(self, trained: tuple[str, ...]) -> dict[str, float]:
        """Close a step in which the adapters `trained` were updated (what to sync); returns `step` and
        `adapters_trained`."""
        self.last_trained = trained
        self.step += 1
        return {"adapters_trained": float(len(trained)), "step": float(self.step)}

    def sft_step(self, batch: TrajectoryBatch) -> dict[str, float]:
        """One supervised step of every adapter with sequences in `batch`, on its own sequences; metrics as
        `NAME/<metric>`."""
        validate_batch(batch)
        metrics: dict[str, float] = {}
        groups = self._by_policy(batch)
        for name, indices in groups.items():
            with self._active(name):
                result = self.trainers[name].sft_step(self._part(batch, indices))
            metrics.update({f"{name}/{k}": v for k, v in result.items()})
        self.last_trained = tuple(groups)
        return metrics

    def begin_sft(self, lr: float, *, warmup_steps: int = 0) -> None:
        """Every adapter's following `sft_step` s use their own fresh optimizer at `lr`."""
        for name, trainer in self.trainers.items():
            with self._active(name):
                trainer.begin_sft(lr, warmup_steps=warmup_steps)

    def compute_logprobs(self, batch: TrajectoryBatch, *, temperature: float | None = None) -> torch.Tensor:
        """Logprobs ``[T]`` of every token under the policy that generated its sequence (an adapter, or the
        base with every adapter off)."""
        batch = validate_batch(batch)
        out = torch.zeros(batch.token_ids.numel(), dtype=torch.float32)
        for name, indices in self._by_policy(batch, allow_base=True).items():
            part = self._part(batch, indices)
            if name == BASE_POLICY:
                with self.model.disable_adapter():
                    lp = next(iter(self.trainers.values())).compute_logprobs(part, temperature=temperature)
            else:
                with self._active(name):
                    lp = self.trainers[name].compute_logprobs(part, temperature=temperature)
            offset = 0
            for i in indices:
                span = batch.sequence(i)
                n = span.stop - span.start
                out[span] = lp[offset : offset + n]
                offset += n
        return out

    def hf_state_dict(self, *, cpu: bool = False) -> dict[str, torch.Tensor]:
        """The frozen base model's weights under their HF names (copies; the adapters are not merged in)."""
        out = {}
        for key, value in self.model.get_base_model().state_dict().items():
            if ".lora_" in key:
                continue
            out[key.replace(".base_layer.", ".")] = value.detach().to(
                "cpu" if cpu else value.device, copy=True
            )
        return out

    def adapter_weights(self, name: str) -> AdapterWeights:
        """Adapter `name` as the engines and PEFT files take it: a consistent snapshot (CPU copies)."""
        from peft import get_peft_model_state_dict

        if name not in self.trainers:
            raise KeyError(f"no adapter {name!r}; adapters: {self.names}")
        spec = self.specs[name].lora
        state = get_peft_model_state_dict(self.model, adapter_name=name)
        return AdapterWeights(
            rank=spec.rank,
            alpha=spec.alpha,
            target_modules=tuple(spec.target_modules),
            tensors={k: v.detach().to("cpu", copy=True) for k, v in state.items()},
            base_model=self.base_model,
        )

    def save_checkpoint(
        self,
        root: str | Path,
        *,
        data_cursor: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        keep_last: int | None = None,
    ) -> Path | None:
        """Every adapter's weights (``NAME/<peft key>`` in ``model.safetensors``), optimizer and schedule, the
        step counts and RNG, under ``root``; plus each adapter as a PEFT folder in ``adapters/NAME/``."""
        weights = {name: self.adapter_weights(name) for name in self.trainers}
        state = {f"{name}/{key}": t for name, w in weights.items() for key, t in w.tensors.items()}
        steps = {name: t.step for name, t in self.trainers.items()}
        path = save_checkpoint(
            root,
            step=self.step,
            model_state=state,
            optimizer_state={n: t.optimizer.state_dict() for n, t in self.trainers.items()},
            scheduler_state={n: t.scheduler.state_dict() for n, t in self.trainers.items()},
            data_cursor=data_cursor,
            extra={**(extra or {}), "adapter_steps": steps},
            rng_states=[capture_rng_state()],
            keep_last=keep_last,
        )
        for name, w in weights.items():
            w.save(path / ADAPTERS_DIR / name)
        return path

    def load_checkpoint(self, path: str | Path) -> Checkpoint:
        """Restore what `save_checkpoint` wrote: every adapter's weights, optimizer, schedule and step count."""
        from peft import set_peft_model_state_dict

        ckpt = load_checkpoint(path)
        for name, trainer in self.trainers.items():
            prefix = f"{name}/"
            state = {k[len(prefix) :]: v for k, v in ckpt.model.items() if k.startswith(prefix)}
            if not state:
                raise CheckpointError(
                    f"{ckpt.path} holds no adapter {name!r} (it has "
                    f"{sorted({k.split('/')[0] for k in ckpt.model})})"
                )
            expected = self.adapter_weights(name).tensors
            if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in expected):
                raise CheckpointError(f"adapter {name!r} in {ckpt.path} does not fit its LoRA settings")
            set_peft_model_state_dict(self.model, state, adapter_name=name)
            if ckpt.optimizer is not None:
                trainer.optimizer.load_state_dict(ckpt.optimizer[name])
            if ckpt.scheduler is not None:
                trainer.scheduler.load_state_dict(ckpt.scheduler[name])
            trainer.step = int(ckpt.extra.get("adapter_steps", {}).get(name, 0))
        self.step = ckpt.step
        if ckpt.rng:
            restore_rng_state(ckpt.rng[0])
        return ckpt

    def save_pretrained(self, directory: str | Path) -> None:
        """The base as an ordinary HF checkpoint folder, and every adapter as a PEFT folder in
        ``adapters/NAME/`` (``peft.PeftModel.from_pretrained(base, folder)`` loads one)."""
        directory = Path(directory)
        self.model.get_base_model().save_pretrained(str(directory), state_dict=self.hf_state_dict(cpu=True))
        for name in self.trainers:
            self.adapter_weights(name).save(directory / ADAPTERS_DIR / name)


def build_lora_trainer(cfg: Any, model: nn.Module) -> MultiLoraTrainer:
    """The trainer of a `TrainConfig` with `adapters:` over `model` (the base, frozen from here on)."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ConfigError("adapters", "LoRA adapters are trained with peft: pip install -e '.[lora]'")
    specs = [
        AdapterSpec(
            a.name,
            a.lora,
            adapter_trainer_config(cfg.trainer, a),
            seed=default_seed(cfg.seed, a.name) if a.seed is None else a.seed,
        )
        for a in cfg.adapters
    ]
    return MultiLoraTrainer(
        model, specs, cfg.torch, cfg.algorithm, base_model=cfg.model.init_from or cfg.model.name
    )
