"""`miles export --adapter NAME`: one adapter of a multi-adapter run as a PEFT folder, or merged into the base
as an ordinary HF checkpoint (`--merge`)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from safetensors import safe_open

from miles.engines.lora import AdapterWeights
from miles.learner.checkpoint import latest_checkpoint
from miles.learner.errors import ConfigError
from miles.training.config import TrainConfig, load_train_config


def adapter_from_checkpoint(cfg: TrainConfig, name: str, checkpoint: str | Path) -> AdapterWeights:
    """Adapter `name` of run config `cfg` as its checkpoint (a `step_*` folder, or the checkpoints root for the
    newest) holds it. Raises `ConfigError` naming the flag to fix."""
    names = [a.name for a in cfg.adapters]
    if name not in names:
        raise ConfigError("--adapter", f"the run has no adapter {name!r} (its adapters: {names or 'none'})")
    spec = next(a for a in cfg.adapters if a.name == name).lora
    path = Path(checkpoint)
    if not (path / "model.safetensors").is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise ConfigError("--checkpoint", f"no complete checkpoint at or under {str(path)!r}")
        path = found
    prefix = f"{name}/"
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        tensors = {k[len(prefix) :]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}  # noqa: SIM118
    if not tensors:
        raise ConfigError("--checkpoint", f"{path} holds no weights of adapter {name!r}")
    return AdapterWeights(
        rank=spec.rank,
        alpha=spec.alpha,
        target_modules=tuple(spec.target_modules),
        tensors=tensors,
        base_model=cfg.model.init_from or cfg.model.name,
    )


def export_adapter(
    run_dir: str | Path,
    name: str,
    out: str | Path,
    *,
    checkpoint: str | Path | None = None,
    merge: bool = False,
) -> Path:
    """Write adapter `name` of the run in `run_dir` (its newest checkpoint, or `checkpoint`) to `out`: a PEFT
    folder, or with `merge` the base model with the adapter merged in (an HF folder with the tokenizer)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError("--run", f"{str(run_dir)!r} is not a run folder (it has no config.yaml)")
    cfg = load_train_config(str(run_dir / "config.yaml"))
    weights = adapter_from_checkpoint(cfg, name, checkpoint or run_dir / "checkpoints")
    out = Path(out)
    if not merge:
        return weights.save(out)
    from peft import PeftModel

    from miles.training.models import build_policy, build_tito

    tito = build_tito(cfg.model)
    base = build_policy(cfg.model, tito.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        model = PeftModel.from_pretrained(base, str(weights.save(Path(tmp) / name))).merge_and_unload()
    model.save_pretrained(str(out))
    tito.tokenizer.save_pretrained(str(out))
    return out
