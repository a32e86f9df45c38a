"""LoRA adapters as the engines take them: `AdapterWeights`, in PEFT's layout, and PEFT folders on disk.

A PEFT folder holds `adapter_config.json` (`peft_type: LORA`, `r`, `lora_alpha`, `target_modules`, ...) and
`adapter_model.safetensors`, whose keys are `base_model.model.<module path>.lora_A.weight` (`[r, in]`) and
`...lora_B.weight` (`[out, r]`). `peft.PeftModel.from_pretrained` loads such a folder, and so does SGLang's LoRA
loader (`/load_lora_adapter`): it reads `r`, `lora_alpha`, `target_modules` and `use_dora` from the config, finds
each weight's layer by its `layers.<i>.` part, and refuses DoRA and adapters that add tokens. An adapter changes
``y = W x`` of each target linear layer into ``y = W x + scaling * B (A x)``, ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with rsLoRA).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from miles.engines.errors import InvalidRequestError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
#: Every linear layer of a Llama/Qwen2-style decoder layer (SGLang stacks q/k/v and gate/up itself).
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
_KEY_RE = re.compile(r"^(?P<module>.+)\.lora_(?P<kind>[AB])\.weight$")


class AdapterError(InvalidRequestError):
    """An adapter that cannot be served: a bad name, a missing or malformed PEFT file, shapes that do not fit."""


def check_adapter_name(name: str) -> str:
    """`name` when it can name an adapter everywhere (peft, SGLang, Prometheus labels, file names): a letter,
    then up to 63 letters, digits, `_` or `-`; not "base" (the base model's policy id) and no part of peft's
    `lora_` prefix. Raises `AdapterError` otherwise."""
    from miles.engine import BASE_POLICY

    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise AdapterError(
            f"adapter name {name!r} must be a letter followed by up to 63 letters, digits, _ or -"
        )
    if name == BASE_POLICY or name in "lora_":
        raise AdapterError(
            f"adapter name {name!r} is reserved (the base policy is {BASE_POLICY!r}; peft's "
            "parameter prefix is 'lora_')"
        )
    return name


@dataclass(frozen=True)
class AdapterWeights:
    """One LoRA adapter: its PEFT settings and tensors under PEFT's names (see the module docstring).

    `tensors` maps `base_model.model.<module>.lora_A.weight` / `.lora_B.weight` to CPU or device tensors;
    `__post_init__` checks that every module has both, with shapes `[rank, in]` and `[out, rank]`.
    """

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    tensors: Mapping[str, torch.Tensor]
    use_rslora: bool = False
    base_model: str = ""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise AdapterError(f"LoRA rank must be >= 1, got {self.rank}")
        if not self.target_modules:
            raise AdapterError("an adapter needs at least one target module")
        pairs = self.modules()
        if not pairs:
            raise AdapterError("the adapter holds no lora_A/lora_B weights")
        for module, (a, b) in pairs.items():
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != self.rank or b.shape[1] != self.rank:
                raise AdapterError(
                    f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit rank "
                    f"{self.rank} (expected [r, in] and [out, r])"
                )

    @property
    def scaling(self) -> float:
        """The factor on ``B (A x)``: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def modules(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Module path in the HF model (``model.layers.0.self_attn.q_proj``) -> ``(A [r, in], B [out, r])``."""
        found: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in self.tensors.items():
            m = _KEY_RE.match(key)
            if m is None or not key.startswith(PEFT_PREFIX):
                raise AdapterError(
                    f"{key!r} is not a PEFT LoRA weight name "
                    f"({PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)"
                )
            found.setdefault(m["module"][len(PEFT_PREFIX) :], {})[m["kind"]] = tensor
        half = sorted(mod for mod, ab in found.items() if len(ab) != 2)
        if half:
            raise AdapterError(f"modules with only one of lora_A / lora_B: {half[:3]}")
        return {mod: (ab["A"], ab["B"]) for mod, ab in found.items()}

    def peft_config(self) -> dict[str, Any]:
        """The `adapter_config.json` content (PEFT's `LoraConfig` fields; what SGLang's loader reads)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self.base_model or None,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": 0.0,
            "target_modules": list(self.target_modules),
            "bias": "none",
            "use_rslora": self.use_rslora,
            "use_dora": False,
            "fan_in_fan_out": False,
            "modules_to_save": None,
            "inference_mode": True,
            "init_lora_weights": True,
        }

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write the PEFT folder (`adapter_config.json`, `adapter_model.safetensors`), replacing `folder`
        atomically: a reader sees the old folder or the new one, never half of one."""
        folder = Path(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-", dir=folder.parent))
        try:
            save_file(
                {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in self.tensors.items()},
                str(tmp / WEIGHTS_FILE),
                metadata={"format": "pt"},
            )
            (tmp / CONFIG_FILE).write_text(json.dumps(self.peft_config(), indent=1))
            if folder.exists():
                trash = Path(tempfile.mkdtemp(prefix=f".old-{folder.name}-", dir=folder.parent))
                os.replace(folder, trash / folder.name)
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return folder

    @classmethod
    def load(cls, folder: str | os.PathLike[str]) -> AdapterWeights:
        """Read a PEFT LoRA folder. Raises `AdapterError` naming what is missing or unsupported."""
        folder = Path(folder)
        if not folder.is_dir():
            raise AdapterError(f"adapter folder {str(folder)!r} does not exist")
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if not (folder / name).is_file():
                raise AdapterError(
                    f"{str(folder)!r} has no {name} (a PEFT LoRA folder has {CONFIG_FILE} and {WEIGHTS_FILE})"
                )
        try:
            config = json.loads((folder / CONFIG_FILE).read_text())
        except ValueError as exc:
            raise AdapterError(f"{folder / CONFIG_FILE} is not JSON: {exc}") from None
        if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
            raise AdapterError(
                f"{folder / CONFIG_FILE}: not a LoRA adapter (peft_type {config.get('peft_type')!r})"
            )
        for key, bad, why in (
            ("use_dora", True, "DoRA"),
            ("bias", "all", "trained biases"),
            ("bias", "lora_only", "trained biases"),
        ):
            if config.get(key) == bad:
                raise AdapterError(f"{folder / CONFIG_FILE}: {why} ({key}: {bad!r}) is not supported")
        if config.get("modules_to_save"):
            raise AdapterError(
                f"{folder / CONFIG_FILE}: modules_to_save {config['modules_to_save']} is not supported"
            )
        targets = config.get("target_modules")
        if isinstance(targets, str):
            targets = [targets]
        try:
            rank, alpha = int(config["r"]), float(config["lora_alpha"])
        except (KeyError, TypeError, ValueError) as exc:
            raise AdapterError(
                f"{folder / CONFIG_FILE}: needs integer r and numeric lora_alpha ({exc})"
            ) from None
        try:
            tensors = load_file(str(folder / WEIGHTS_FILE))
        except Exception as exc:  # a truncated or forged file (a header that claims a terabyte)
            raise AdapterError(
                f"cannot read {folder / WEIGHTS_FILE}: {type(exc).__name__}: {str(exc).strip()[:200]}"
            ) from None
        return cls(
            rank=rank,
            alpha=alpha,
            target_modules=tuple(targets or ()),
            tensors=tensors,
            use_rslora=bool(config.get("use_rslora", False)),
            base_model=str(config.get("base_model_name_or_path") or ""),
        )


def served_name(name: str, version: int) -> str:
    """The name an adapter version is loaded under on an SGLang server (`/load_lora_adapter` refuses a name it
    already holds, so each version gets its own and the old one is unloaded once its requests are done)."""
    return f"{name}@v{version}"
