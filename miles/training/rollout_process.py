"""The rollout process of the asynchronous loop: it runs a `RolloutManager` (the scheduler, its router, the
engines and the recorder) and streams finished groups to the trainer.

Transport: a `RolloutLink`. To a child process (`ChildLink`) it is two `torch.multiprocessing` queues (spawn
context): the trainer's messages go in `inbox`, the manager's come back in `outbox`. Weights for the process's
embedded engines travel in the queue itself: CPU tensors through shared memory, CUDA tensors through CUDA IPC,
and the trainer holds on to them until the manager says they are loaded. HTTP engines take their weights from
the trainer's own weight sync; the manager only learns the new version (and, with `inflight: continue`, holds
new turns while it lands). On Ray the manager runs in an actor (`miles.training.cluster.rollout.ActorLink`).

Neither side shares Python state or an event loop with the other; `RolloutHandle` is the trainer's handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import queue
import sys
import threading
import time
import traceback
import types
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from miles.sessions.records import SessionRecord
from miles.training.config import TrainConfig

log = logging.getLogger(__name__)


class RolloutManagerError(RuntimeError):
    """The rollout process died, failed, or sent nothing for too long; the run can continue with `--resume`."""


# ---- messages, trainer -> manager ----------------------------------------------------------------------
@dataclass(frozen=True)
class Weights:
    """The engines now get weights `version`: `state_dict` for the process's own (embedded) engines, or None
    when the trainer already pushed them to HTTP engines (this then ends a `Hold`)."""

    version: int
    state_dict: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class Hold:
    """Stop starting turns and let the ones in flight finish; answer `Ack(version)` once none is left."""

    version: int


@dataclass(frozen=True)
class Requeue:
    """The group of the task at cursor `position` takes no place under the staleness bound any more (it was
    over the bound, or it trained nothing): start another group in its place, running that task again when
    `rerun` (`async.stale: regenerate`), else the next task."""

    position: int
    rerun: bool = True


@dataclass(frozen=True)
class Stop:
    """Abort what runs, record it, and exit."""


# ---- messages, manager -> trainer ----------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """The engines are up and the manager waits for the first weights."""


@dataclass(frozen=True)
class Finished:
    """A finished group: its sessions' records, its task's cursor position, the seconds the engines have
    been idle since the process started (cumulative), and the version the oldest group still running was
    admitted under (None when none runs; `RolloutManager.oldest_running`)."""

    records: list[SessionRecord]
    position: int
    engine_idle_s: float
    oldest_running: int | None = None
    buffered_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Ack:
    """Weights `version` are loaded (or, after a `Hold`, nothing is in flight)."""

    version: int


#: Seconds an orphaned rollout process gets to record its aborted sessions before it exits regardless.
ORPHAN_EXIT_S = 20.0


@dataclass(frozen=True)
class Failed:
    """The manager failed; `message` is one line."""

    message: str


@dataclass(frozen=True)
class RolloutStart:
    """Where the manager starts: the cursor `position`, positions already trained on (`skip`), the weight
    version the engines will first hold, the run id of its sessions, and for a resumed run the checkpoint's
    time (sessions started after it are moved aside first)."""

    position: int = 0
    skip: tuple[int, ...] = ()
    first_version: int = 1
    run_id: str = "train"
    resume_time: float | None = None


# ---- the rollout process ------------------------------------------------------------------------------
def rollout_main(cfg: TrainConfig, start: RolloutStart, inbox: Any, outbox: Any) -> None:
    """The rollout process's entry point (`torch.multiprocessing` spawn target)."""
    torch.set_num_threads(cfg.asynchronous.rollout_threads or 1)
    try:
        asyncio.run(_serve(cfg, start, inbox, outbox))
    except BaseException as exc:  # the trainer must hear about it, in one line
        outbox.put(Failed(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"))
        raise SystemExit(1) from None


async def _serve(cfg: TrainConfig, start: RolloutStart, inbox: Any, outbox: Any) -> None:
    from miles.sessions.manager import RolloutManager, TaskFeed
    from miles.sessions.recorder import Recorder
    from miles.training.data import TaskCursor
    from miles.training.models import build_policy
    from miles.training.rollout_side import RolloutData, RolloutSide

    cfg.env.recipe.import_modules()
    data = RolloutData.load(cfg)
    side = await RolloutSide.build(cfg, data, build_policy(cfg.model, data.tito.tokenizer))
    engines = side.engine_set
    tasks = data.train_tasks
    cursor = TaskCursor(len(tasks), cfg.seed)
    recorder = Recorder(Path(cfg.output_dir) / "sessions.jsonl")
    if start.resume_time is not None:
        recorder.drop_after(start.resume_time)
    scheduler = side.training_scheduler(recorder=recorder, run_id=start.run_id)
    manager = RolloutManager(
        scheduler,
        TaskFeed(lambda p: tasks[cursor.index_at(p)], start=start.position, skip=start.skip),
        groups_per_version=cfg.rollout.tasks_per_step,
        max_staleness=cfg.asynchronous.max_staleness,
        first_version=start.first_version,
    )
    messages: asyncio.Queue[Any] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    trainer = multiprocessing.parent_process()  # None in a Ray actor: Ray ends the actor with its owner
    for target, name in ((_forward, "rollout-inbox"), (_watch_trainer, "rollout-watch")):
        threading.Thread(
            target=target, args=(inbox, outbox, loop, messages, trainer), name=name, daemon=True
        ).start()
    first_weights = asyncio.Event()
    idle = _IdleClock(scheduler)
    outbox.put(Ready())

    async def control() -> None:
        held: contextlib.AbstractAsyncContextManager[None] | None = None
        while True:
            msg = await messages.get()
            if isinstance(msg, Stop):
                return
            if isinstance(msg, Requeue):
                manager.replace(msg.position, rerun=msg.rerun)
            elif isinstance(msg, Hold):
                held = scheduler.router.held()
                await held.__aenter__()
                outbox.put(Ack(msg.version))
            elif isinstance(msg, Weights):
                if msg.state_dict is not None:
                    sd = msg.state_dict

                    async def load(sd: dict[str, torch.Tensor] = sd, version: int = msg.version) -> None:
                        await asyncio.gather(
                            *(e.update_weights(state_dict=sd, version=version) for e in engines.workers)
                        )

                    if first_weights.is_set():
                        await manager.update_weights(load, cfg.asynchronous.inflight)
                    else:
                        await load()
                elif held is not None:
                    await held.__aexit__(None, None, None)
                    held = None
                manager.set_version(msg.version)
                first_weights.set()
                outbox.put(Ack(msg.version))

    async def stream() -> None:
        await first_weights.wait()
        async for group, position in manager.stream():
            outbox.put(
                Finished(
                    records=group.records,
                    position=position,
                    engine_idle_s=idle.total,
                    oldest_running=manager.oldest_running,
                )
            )

    streaming = asyncio.create_task(stream())
    idle.start()
    try:
        done, _ = await asyncio.wait(
            {streaming, asyncio.create_task(control())}, return_when=asyncio.FIRST_COMPLETED
        )
        for task in done:
            task.result()  # a failure in either raises here
    finally:
        streaming.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await streaming
        idle.stop()
        await scheduler.aclose()
        await recorder.aclose()
        await engines.close()


def _exit_soon() -> None:
    """Leave within `ORPHAN_EXIT_S`, whatever the process is blocked on by then."""
    threading.Timer(ORPHAN_EXIT_S, os._exit, (1,)).start()


def _forward(
    inbox: Any, outbox: Any, loop: asyncio.AbstractEventLoop, messages: asyncio.Queue[Any], trainer: Any
) -> None:
    """Hand the trainer's messages to the event loop, one by one (a blocking queue read in its own thread). A
    read that fails because the trainer died while sending (a shared tensor's descriptor handshake broke off)
    ends the thread quietly: `_watch_trainer` stops the process."""
    while True:
        try:
            msg = inbox.get(timeout=1.0)
        except queue.Empty:
            continue
        except Exception:
            if trainer is not None:
                trainer.join(2.0)
                if not trainer.is_alive():
                    return
            raise
        loop.call_soon_threadsafe(messages.put_nowait, msg)
        if isinstance(msg, Stop):
            return


def _watch_trainer(
    inbox: Any,
    outbox: Any,
    loop: asyncio.AbstractEventLoop,
    messages: asyncio.Queue[Any],
    trainer: Any,
    on_orphan: Callable[[], None] = _exit_soon,
) -> None:
    """A trainer process that died without a word (SIGKILL, SIGTERM) counts as a `Stop`: the sessions in flight
    are aborted and recorded, and `on_orphan` makes the process leave within `ORPHAN_EXIT_S` whatever it is
    blocked on (a full pipe to the dead trainer, a wedged engine, a read of a message the trainer never
    finished): no orphan keeps running. Nothing to watch in a Ray actor (`trainer` None)."""
    if trainer is None:
        return
    while trainer.is_alive():
        trainer.join(1.0)
    outbox.cancel_join_thread()  # nobody reads it any more: exiting must not wait to flush it
    on_orphan()
    loop.call_soon_threadsafe(messages.put_nowait, Stop())


class _IdleClock:
    """Seconds during which no generate call was in flight on any engine (sampled every 20 ms)."""

    def __init__(self, scheduler: Any, period_s: float = 0.02) -> None:
        self.scheduler, self.period_s = scheduler, period_s
        self.total = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.period_s)
            now = time.monotonic()
            if self.scheduler.router.inflight == 0:
                self.total += now - last
            last = now


# ---- the trainer's handle -----------------------------------------------------------------------------
def _dead_peer_handshake(exc_type: type[BaseException], tb: types.TracebackType | None) -> bool:
    """Whether an error comes from handing a shared tensor's file descriptor (`multiprocessing.resource_sharer`,
    whose serving thread reports it through `sys.excepthook` and goes on) to a process that died meanwhile."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    return issubclass(exc_type, (ConnectionError, EOFError)) and any(
        f.filename.endswith(os.path.join("multiprocessing", "resource_sharer.py")) for f in frames
    )


def _quiet_dead_peer_handshakes() -> None:
    """Keep a dead rollout process's unfinished descriptor handshakes out of stderr (its death is reported
    as one line of its own); every other error still reaches the previous hook. Installed once per process."""
    previous = sys.excepthook
    if getattr(previous, "quiets_dead_peers", False):
        return

    def hook(exc_type: type[BaseException], exc: BaseException, tb: types.TracebackType | None) -> None:
        if _dead_peer_handshake(exc_type, tb):
            log.debug("a descriptor handshake with a dead process failed: %r", exc)
        else:
            previous(exc_type, exc, tb)

    hook.quiets_dead_peers = True  # type: ignore[attr-defined]
    sys.excepthook = hook


class RolloutLink(Protocol):
    """The trainer's end of the wire to the rollout manager, wherever the manager runs: a child process
    (`ChildLink`) or a Ray actor (`miles.training.cluster.rollout.ActorLink`)."""

    def send(self, message: Any) -> None:
        """Hand the manager `message`; messages arrive in the order they were sent."""
        ...

    def receive(self, timeout_s: float) -> Any | None:
        """The manager's next message, or None when none came within `timeout_s`."""
        ...

    def waiting(self) -> int:
        """Messages the manager sent that were not received yet (0 where the transport cannot tell)."""
        ...

    def exit_code(self) -> int | None:
        """None while the manager runs; then its exit status (1 when it died without one)."""
        ...

    def wait_exit(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the manager to exit."""
        ...

    def kill(self) -> None:
        """End the manager now."""
        ...

    def release(self) -> None:
        """Let go of the transport once the manager has exited or was killed."""
        ...


class ChildLink:
    """`RolloutLink` to a manager in a spawned child process, over two `torch.multiprocessing` queues."""

    def __init__(self, inbox: Any, outbox: Any, process: multiprocessing.process.BaseProcess) -> None:
        self.inbox, self.outbox, self.process = inbox, outbox, process

    @classmethod
    def start(cls, cfg: TrainConfig, start: RolloutStart) -> ChildLink:
        """Start `rollout_main` in a spawned child process with `async.rollout_threads` torch threads."""
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        _quiet_dead_peer_handshakes()
        inbox, outbox = ctx.Queue(), ctx.Queue()
        process = ctx.Process(
            target=rollout_main, args=(cfg, start, inbox, outbox), name="miles-rollout", daemon=True
        )
        env_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(cfg.asynchronous.rollout_threads or 1)
        try:
            process.start()
        finally:
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_threads
        return cls(inbox, outbox, process)

    def send(self, message: Any) -> None:
        self.inbox.put(message)

    def receive(self, timeout_s: float) -> Any | None:
        try:
            return self.outbox.get(True, timeout_s)
        except queue.Empty:
            return None

    def waiting(self) -> int:
        try:
            return self.outbox.qsize()
        except NotImplementedError:  # macOS
            return 0

    def exit_code(self) -> int | None:
        return None if self.process.is_alive() else self.process.exitcode

    def wait_exit(self, timeout_s: float) -> None:
        self.process.join(timeout_s)

    def kill(self) -> None:
        self.process.terminate()

    def release(self) -> None:
        for q in (self.inbox, self.outbox):
            q.cancel_join_thread()
            q.close()


class RolloutHandle:
    """The trainer's handle on the rollout manager: `next_group()`, `publish()`, `hold()`, `requeue()`,
    `close()`, over a `RolloutLink`, so its callers never change with where the manager runs
    (`miles.training.placement.launch_rollout` picks the link).

    A dead or silent manager raises `RolloutManagerError` from whichever call notices it.
    """

    def __init__(self, link: RolloutLink, *, timeout_s: float) -> None:
        self.link = link
        self.timeout_s = timeout_s
        self.groups: deque[Finished] = deque()
        self.acked = 0
        self._sent: dict[int, Any] = {}  # weights kept alive until the manager has loaded them
        self._ready = False

    @property
    def buffered(self) -> int:
        """Finished groups received and not yet taken."""
        return len(self.groups) + self.link.waiting()

    async def _receive(self, deadline_s: float) -> None:
        """Take one message from the manager (waiting up to `deadline_s`) and file it."""
        end = time.monotonic() + deadline_s
        while (msg := await asyncio.to_thread(self.link.receive, 0.5)) is None:
            if (code := self.link.exit_code()) is not None:
                raise RolloutManagerError(
                    f"the rollout process exited with code {code}; continue the run with --resume"
                )
            if time.monotonic() > end:
                raise RolloutManagerError(
                    f"the rollout process sent nothing for {deadline_s:.0f} s (async.manager_timeout_s)"
                )
        if isinstance(msg, Failed):
            raise RolloutManagerError(f"the rollout process failed: {msg.message}")
        if isinstance(msg, Finished):
            self.groups.append(msg)
        elif isinstance(msg, Ack):
            self.acked = max(self.acked, msg.version)
            for v in [v for v in self._sent if v <= msg.version]:
                del self._sent[v]
        elif isinstance(msg, Ready):
            self._ready = True

    async def ready(self) -> None:
        """Wait until the manager's engines are up."""
        while not self._ready:
            await self._receive(self.timeout_s)

    async def next_group(self) -> Finished:
        """The next finished group, in the order the manager finished them."""
        while not self.groups:
            await self._receive(self.timeout_s)
        return self.groups.popleft()

    async def wait_acked(self, version: int) -> None:
        """Wait until the manager has loaded weights `version` (or, after `hold`, has nothing in flight)."""
        while self.acked < version:
            await self._receive(self.timeout_s)

    def _drain_until_exit(self, timeout_s: float) -> None:
        """Read, and drop, what the manager still sends until it exits (up to `timeout_s`): a process cannot
        exit while its queue holds messages the pipe has no room for, and nobody would read them any more."""
        end = time.monotonic() + timeout_s
        while self.link.exit_code() is None and time.monotonic() < end:
            self.link.receive(0.1)
        self.link.wait_exit(max(0.0, end - time.monotonic()))

    def publish(self, version: int, state_dict: dict[str, torch.Tensor] | None) -> None:
        """Send weights `version` (see `Weights`); returns at once, `wait_acked` waits for them to land."""
        if state_dict is not None:
            self._sent[version] = state_dict
        self.link.send(Weights(version, state_dict))

    async def hold(self, version: int) -> None:
        """Make the manager hold new turns and drain the ones in flight (before an HTTP weight push)."""
        self.link.send(Hold(version))
        await self.wait_acked(version)

    def requeue(self, position: int, *, rerun: bool) -> None:
        """Tell the manager the group of `position` takes no place under the bound any more (too stale, or it
        trained nothing): start another in its place, running that task again when `rerun`."""
        self.link.send(Requeue(position, rerun))

    async def close(self, timeout_s: float = 60.0) -> None:
        """Stop the manager (its running sessions are aborted and recorded) and wait for it to exit."""
        if self.link.exit_code() is None:
            self.link.send(Stop())
            await asyncio.to_thread(self._drain_until_exit, timeout_s)
        if self.link.exit_code() is None:
            self.link.kill()
            await asyncio.to_thread(self.link.wait_exit, 10.0)
        self._sent.clear()
        self.link.release()
