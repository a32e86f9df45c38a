"""Atomic training checkpoints: model, optimizer, scheduler, step, RNG states and the data cursor.

Layout under a root directory::

    root/step_00000012/model.safetensors   HF-layout weights (loadable by transformers)
    root/step_00000012/optimizer.pt        optimizer state dict (torch.save, weights_only-loadable)
    root/step_00000012/state.pt            scheduler state and RNG states of every rank
    root/step_00000012/meta.json           step, data cursor, extra, format version
    root/latest                            name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory and renamed into place, and ``latest`` is
replaced atomically afterwards, so a killed run leaves either the old or the new checkpoint, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from miles.learner.errors import CheckpointError

FORMAT_VERSION = 1
PREFIX = "step_"
LATEST = "latest"
_FILES = ("model.safetensors", "state.pt", "meta.json")


@dataclass
class Checkpoint:
    """What `load_checkpoint` returns; state dicts are on CPU."""

    path: Path
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    rng: list[dict[str, Any]] = field(default_factory=list)
    data_cursor: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    passed_over: list[str] = field(default_factory=list)  # newer checkpoints found damaged, and why


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU (and CUDA, when present) generator states, in weights_only-loadable types."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": _to_lists(random.getstate()),
        "numpy": {
            "kind": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng_state`."""
    random.setstate(_to_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: str | Path,
    *,
    step: int,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any] | None = None,
    scheduler_state: dict[str, Any] | None = None,
    data_cursor: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    rng_states: list[dict[str, Any]] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write checkpoint ``root/step_<step>`` atomically and point ``root/latest`` at it; return its path.

    ``rng_states`` holds one `capture_rng_state` dict per rank (default: this process's).
    ``data_cursor`` and ``extra`` must be JSON-serializable. ``keep_last`` prunes older checkpoints.
    """
    if step < 0:
        raise CheckpointError(f"step must be >= 0, got {step}")
    meta = {
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "data_cursor": data_cursor or {},
        "extra": extra or {},
        "has_optimizer": optimizer_state is not None,
    }
    try:
        json.dumps(meta)
    except TypeError as e:
        raise CheckpointError(f"data_cursor and extra must be JSON-serializable: {e}") from e
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"{PREFIX}{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    try:
        save_file(
            {k: v.detach().to("cpu").contiguous().clone() for k, v in model_state.items()},
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(
            {"scheduler": scheduler_state, "rng": rng_states or [capture_rng_state()]}, tmp / "state.pt"
        )
        meta["files"] = {f.name: _sha256(f) for f in sorted(tmp.iterdir())}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        for f in tmp.iterdir():
            _fsync(f)
        final = root / name
        if final.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".old-{name}-", dir=root))
            os.replace(final, trash / name)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_atomic(root / LATEST, name)
    if keep_last is not None and keep_last > 0:
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and _complete(p)]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``root/latest`` names, else the newest complete one, else None."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        p = root / pointer.read_text().strip()
        if _complete(p):
            return p
    found = list_checkpoints(root)
    return found[-1] if found else None


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Load a checkpoint directory, or the newest intact checkpoint under a root directory.

    Every file is checked against the SHA-256 that `save_checkpoint` recorded. Under a root, a damaged newest
    checkpoint is passed over for the one before it (`Checkpoint.passed_over` says which and why); a damaged
    checkpoint named directly, or a root with none intact, is a `CheckpointError`.
    """
    path = Path(path)
    if _complete(path):
        return _load_one(path)
    candidates = list_checkpoints(path)
    latest = latest_checkpoint(path)
    if latest is not None and latest in candidates:  # `latest` first, then the others, newest first
        candidates.remove(latest)
        candidates.append(latest)
    if not candidates:
        raise CheckpointError(f"no complete checkpoint at or under {path}")
    passed_over: list[str] = []
    for candidate in reversed(candidates):
        try:
            ckpt = _load_one(candidate)
        except CheckpointError as exc:
            passed_over.append(str(exc))
            continue
        ckpt.passed_over = passed_over
        return ckpt
    raise CheckpointError(f"every checkpoint under {path} is damaged: " + "; ".join(passed_over))


def _load_one(path: Path) -> Checkpoint:
    try:
        return _read(path)
    except CheckpointError:
        raise
    except Exception as exc:  # a truncated or garbled file that slipped past the checksums (or had none)
        raise CheckpointError(f"{path.name} cannot be read: {type(exc).__name__}: {str(exc)[:200]}") from exc


def _read(path: Path) -> Checkpoint:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path.name}: meta.json is damaged ({exc})") from exc
    for name, digest in (meta.get("files") or {}).items():
        if not (path / name).is_file() or _sha256(path / name) != digest:
            raise CheckpointError(f"{path.name}: {name} is damaged (its SHA-256 is not the one recorded)")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported checkpoint format {meta.get('format_version')!r}")
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    optimizer = None
    if meta.get("has_optimizer"):
        if not (path / "optimizer.pt").is_file():
            raise CheckpointError(f"{path}: optimizer.pt is missing")
        optimizer = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    return Checkpoint(
        path=path,
        step=int(meta["step"]),
        model=load_file(str(path / "model.safetensors")),
        optimizer=optimizer,
        scheduler=state["scheduler"],
        rng=list(state["rng"]),
        data_cursor=meta["data_cursor"],
        extra=meta["extra"],
    )


def _complete(p: Path) -> bool:
    return p.is_dir() and all((p / f).is_file() for f in _FILES)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _to_lists(x: Any) -> Any:
    return [_to_lists(v) for v in x] if isinstance(x, tuple | list) else x


def _to_tuples(x: Any) -> Any:
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x


def elapsed_at_latest(root: str | Path) -> float:
    """Seconds of its budget the run had spent when its newest checkpoint under `root` was written (0 when
    there is none, or it does not say)."""
    latest = latest_checkpoint(root)
    if latest is None:
        return 0.0
    try:
        return float(json.loads((latest / "meta.json").read_text())["extra"].get("elapsed_s", 0.0))
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0
