"""Helpers for tests and benchmarks of the engines: small random Qwen2 models, server subprocesses, spawned children."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from transformers import Qwen2ForCausalLM

from miles.engine import EngineError
from miles.ports import free_port
from miles.tiny import make_tiny_model


def small_qwen2(
    seed: int = 0,
    *,
    vocab_size: int = 512,
    size: str = "0.1m",
    eos_token_id: int | None = None,
    max_position_embeddings: int = 2048,
) -> Qwen2ForCausalLM:
    """`miles.tiny.make_tiny_model` (0.1M parameters by default, deterministic for a seed) with a small
    vocabulary and, unless `eos_token_id` is given, no EOS, so random weights generate to the budget."""
    model = make_tiny_model(
        size, vocab_size=vocab_size, seed=seed, max_position_embeddings=max_position_embeddings
    )
    model.config.eos_token_id = eos_token_id
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = None
    return model.eval()


def save_tiny_checkpoint(folder: str | Path, seed: int = 0) -> Path:
    """An HF folder that `python -m miles.engines --model FOLDER` serves: `small_qwen2` over the tiny tokenizer's
    vocabulary (with its EOS), and the tokenizer."""
    from miles.tiny import load_tiny_tokenizer

    tok = load_tiny_tokenizer()
    small_qwen2(seed, vocab_size=len(tok), eos_token_id=tok.eos_token_id).save_pretrained(folder)
    tok.save_pretrained(folder)
    return Path(folder)


class ServerProcess:
    """`python -m miles.engines --model PATH` in a subprocess on a free loopback port (killable)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        port: int | None = None,
        startup_timeout_s: float = 90.0,
        log_path: str | Path | None = None,
        wait: bool = True,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "miles.engines", "--model", str(model_path), "--port", str(self.port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.startup_timeout_s = startup_timeout_s
        if wait:
            self.wait_ready()

    @classmethod
    def start_many(cls, model_path: str | Path, n: int, **kwargs: object) -> list[ServerProcess]:
        """Start `n` servers at once (their imports overlap) and wait for all of them."""
        servers = [cls(model_path, wait=False, **kwargs) for _ in range(n)]  # type: ignore[arg-type]
        try:
            for s in servers:
                s.wait_ready()
        except EngineError:
            for s in servers:
                s.kill()
            raise
        return servers

    def wait_ready(self) -> None:
        """Block until `/health` answers 200."""
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.process.poll() is not None:
                raise EngineError(f"server exited with {self.process.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise EngineError(f"server on {self.url} did not come up")
            time.sleep(0.1)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


class RolloutProcess:
    """`python -m miles.cli rollout ARGS` in a subprocess; `ready()` reads its stdout until it serves and returns
    the `engine:` section it printed (and `router_url`, when it started a router)."""

    def __init__(self, *args: str, cwd: str | Path | None = None) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "miles.cli", "rollout", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.router_url: str | None = None

    def ready(self) -> dict[str, Any]:
        """Read the launcher's output up to its "Ctrl-C or SIGTERM" line; the printed `engine:` section."""
        import yaml

        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line)
            if "use the router:" in line:
                self.router_url = line.rsplit(" ", 1)[1].strip()
            if "Ctrl-C or SIGTERM" in line:
                return next(yaml.safe_load(x) for x in self.lines if x.startswith("engine:"))["engine"]
        raise EngineError(
            f"the launcher exited {self.proc.wait()}: {''.join(self.lines)}{self.proc.stderr.read()}"
        )

    def finish(self, sig: int, timeout_s: float = 60) -> tuple[int, str]:
        """Send `sig` and wait; the exit status and stderr."""
        self.proc.send_signal(sig)
        out, err = self.proc.communicate(timeout=timeout_s)
        self.lines.append(out)
        return self.proc.returncode, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def spawned_child(parent_pid: int) -> int | None:
    """The pid of a `multiprocessing` spawn child of `parent_pid` (a rollout or trainer process), from /proc."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent_pid and "spawn_main" in cmdline:
                return int(entry.name)
    return None


def exits_within(pid: int, timeout_s: float) -> bool:
    """Whether process `pid` is gone (or a zombie awaiting its parent) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if "zombie" in (Path(f"/proc/{pid}") / "status").read_text():
                return True
        except OSError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
