"""`TrainerProcess`: a trainer built and driven in a process of its own.

The parent sends the trainer `miles.learner.commands.TrainerCommand` s (method calls, attribute reads and
writes) through a `multiprocessing` pipe (spawn context), one at a time, and the trainer process runs each with
`miles.learner.commands.apply`. Arguments and results travel pickled by value (a step's batch or an adapter's
weights are a few MB: a copy through the pipe costs less than setting up shared memory for each of their
tensors), as the `Trainer` protocol allows. The trainer's work then shares neither an interpreter lock nor a
core with the parent's engines and sessions. An error raised by a command is raised again in the parent, of the
same type, with the trainer process's traceback as a note; a trainer process that dies is a
`TrainerProcessError`.
"""

from __future__ import annotations

import pickle
import signal
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as torch_mp

from miles.learner.commands import STOP, CommandKind, TrainerCommand, apply


class TrainerProcessError(RuntimeError):
    """The trainer process exited; the run stops with its checkpoints intact and can continue with `--resume`."""


@dataclass(frozen=True)
class _Request:
    command: TrainerCommand
    threads: int | None = None  # torch threads from this command on (None: as they are)


@dataclass(frozen=True)
class _Reply:
    value: Any = None
    error: BaseException | None = None
    trace: str = ""


def _send(conn: Any, obj: Any) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Any) -> Any:
    return pickle.loads(conn.recv_bytes())


def _failure(exc: BaseException) -> _Reply:
    try:
        pickle.dumps(exc)
        error = exc
    except Exception:  # an error that cannot cross the pipe is sent as its text
        error = RuntimeError(f"{type(exc).__name__}: {exc}")
    return _Reply(error=error, trace=traceback.format_exc())


def _serve(build: Callable[..., Any], args: tuple[Any, ...], conn: Any, threads: int) -> None:
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # Ctrl-C reaches the whole process group; the parent ends this one
    torch.set_num_threads(threads)
    try:
        trainer = build(*args)
    except Exception as exc:
        _send(conn, _failure(exc))
        return
    _send(conn, _Reply())
    while True:
        try:
            request = _recv(conn)
        except EOFError:  # the parent is gone
            return
        if request.command.kind is CommandKind.STOP:
            return
        if request.threads is not None:
            torch.set_num_threads(request.threads)
        try:
            reply = _Reply(value=apply(trainer, request.command))
        except Exception as exc:
            reply = _failure(exc)
        try:
            _send(conn, reply)
        except Exception as exc:  # a result that cannot cross the pipe
            _send(conn, _failure(exc))


class TrainerProcess:
    """`build(*args)` run in a new process (`threads` torch threads), and the trainer it returns served there.

    Construction waits until the trainer is built and raises what building it raised. `call` is thread-safe:
    calls from several threads take turns.
    """

    def __init__(
        self, build: Callable[..., Any], *args: Any, threads: int | None = None, name: str = "miles-trainer"
    ) -> None:
        ctx = torch_mp.get_context("spawn")  # the model argument: CPU tensors in shared memory
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve,
            name=name,
            daemon=True,
            args=(build, args, child, threads or torch.get_num_threads()),
        )
        self._proc.start()
        child.close()
        self._lock = threading.Lock()
        try:
            with self._lock:
                self._answer(self._receive("start"))
        except BaseException:
            self.close()
            raise

    def _receive(self, what: str) -> _Reply:
        try:
            return _recv(self._conn)
        except (EOFError, OSError):
            self._proc.join(timeout=5)
            if what == "start":  # nothing trained yet: a resume would not help
                raise TrainerProcessError(
                    f"the trainer process exited (exit code {self._proc.exitcode}) while starting (its output is "
                    "above); a script that starts a run when imported must do so under `if __name__ == "
                    '"__main__":`, since the new process imports the script again'
                ) from None
            raise TrainerProcessError(
                f"the trainer process exited (exit code {self._proc.exitcode}) during "
                f"{what}; continue the run with --resume"
            ) from None

    @staticmethod
    def _answer(reply: _Reply) -> Any:
        if reply.error is not None:
            reply.error.add_note(f"raised in the trainer process:\n{reply.trace}")
            raise reply.error
        return reply.value

    def apply(self, command: TrainerCommand, *, threads: int | None = None) -> Any:
        """`command` run on the trainer in the trainer process (with `threads` torch threads from then on)."""
        with self._lock:
            if not self._proc.is_alive():
                raise TrainerProcessError(
                    f"the trainer process exited (exit code {self._proc.exitcode}); "
                    "continue the run with --resume"
                )
            try:
                _send(self._conn, _Request(command, threads))
            except OSError:
                pass  # the reply's absence names the failure
            return self._answer(self._receive(command.label))

    def call(self, method: str, /, *args: Any, threads: int | None = None, **kwargs: Any) -> Any:
        """`trainer.method(*args, **kwargs)` in the trainer process (with `threads` torch threads from then on)."""
        return self.apply(TrainerCommand.call(method, *args, **kwargs), threads=threads)

    def get(self, attribute: str) -> Any:
        """The trainer's `attribute`."""
        return self.apply(TrainerCommand.read(attribute))

    def set(self, attribute: str, value: Any) -> None:
        """Set the trainer's `attribute` to `value`."""
        self.apply(TrainerCommand.write(attribute, value))

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def close(self, timeout_s: float = 30.0) -> None:
        """Let the trainer process exit (killed after `timeout_s`). Idempotent."""
        with self._lock:
            if self._proc.is_alive():
                try:
                    _send(self._conn, _Request(STOP))
                except OSError:
                    pass
                self._proc.join(timeout_s)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
            self._conn.close()
