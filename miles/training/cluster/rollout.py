"""The rollout manager of the asynchronous loop as a Ray actor (`cluster.kind: ray`, `async.enabled`).

`RolloutManagerActor` runs the rollout process's own body (`rollout_main`: the `RolloutManager` with its
scheduler, router and recorder, against the engine actors' URLs) in a thread, with two in-actor queues in
place of the process's `torch.multiprocessing` queues. `spawn_on_ray` gives the trainer its handle: the same
`RolloutProcess` (next_group, publish, hold, requeue, close), over the actor's `Channel` and `Worker` instead of
a child process's.
"""

from __future__ import annotations

import os
import queue
from typing import Any

from miles.training.cluster.config import enter_driver_folder
from miles.training.config import TrainConfig
from miles.training.rollout_process import RolloutProcess, RolloutStart, rollout_main


class RolloutManagerActor:
    """Runs `rollout_main` (see the module docstring); `put` hands it a trainer message, `take` returns the
    manager's next message (None when none came within `timeout_s`)."""

    def __init__(self, cfg: TrainConfig, start: RolloutStart, folder: str) -> None:
        enter_driver_folder(folder)
        self.cfg, self.start = cfg, start
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.outbox: queue.Queue[Any] = queue.Queue()

    def run(self) -> int:
        """The manager's whole life; returns its exit status (it reported a failure in the outbox first)."""
        try:
            rollout_main(self.cfg, self.start, self.inbox, self.outbox)
        except SystemExit as exc:  # rollout_main's way to exit 1: this thread ends, the actor stays
            return int(exc.code or 0)
        return 0

    def put(self, message: Any) -> None:
        self.inbox.put(message)

    def take(self, timeout_s: float | None) -> Any:
        try:
            return self.outbox.get(True, timeout_s)
        except queue.Empty:
            return None

    def qsize(self) -> int:
        return self.outbox.qsize()


class _Mailbox:
    """The actor's two queues as the trainer sees them: `put` goes to the manager, `get` and `qsize` read what
    it sent; with the `multiprocessing` queue methods `RolloutProcess` uses."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def put(self, message: Any) -> None:
        import ray

        ray.get(self.actor.put.remote(message))  # waited for: the manager sees messages in the order sent

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        import ray

        try:
            message = ray.get(self.actor.take.remote(timeout if block else 0.0))
        except ray.exceptions.RayActorError:
            message = None  # the actor is gone: the caller finds out from `is_alive`
        if message is None:
            raise queue.Empty
        return message

    def qsize(self) -> int:
        import ray

        try:
            return int(ray.get(self.actor.qsize.remote()))
        except ray.exceptions.RayActorError:
            return 0

    def cancel_join_thread(self) -> None:
        pass

    def close(self) -> None:
        pass


class _ActorProcess:
    """The actor's `run` call, with the `multiprocessing.Process` methods `RolloutProcess` uses; its exit code
    is the manager's status, or 1 when the actor died."""

    def __init__(self, actor: Any, run: Any) -> None:
        self.actor, self.run = actor, run

    def is_alive(self) -> bool:
        import ray

        ready, _ = ray.wait([self.run], timeout=0)
        return not ready

    @property
    def exitcode(self) -> int | None:
        import ray

        if self.is_alive():
            return None
        try:
            return int(ray.get(self.run))
        except ray.exceptions.RayError:
            return 1

    def join(self, timeout: float | None = None) -> None:
        import ray

        ray.wait([self.run], timeout=timeout)

    def terminate(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


def spawn_on_ray(cfg: TrainConfig, start: RolloutStart) -> RolloutProcess:
    """`RolloutProcess` with the manager in a `RolloutManagerActor` (placed by `cluster.manager`)."""
    import ray

    manager = cfg.cluster.manager
    actor = (
        ray.remote(RolloutManagerActor)
        .options(
            num_cpus=manager.cpus,
            resources=dict(manager.resources) or None,
            max_restarts=0,
            max_concurrency=4,
        )
        .remote(cfg, start, os.getcwd())
    )
    mailbox = _Mailbox(actor)
    return RolloutProcess(
        mailbox,
        mailbox,
        _ActorProcess(actor, actor.run.remote()),
        timeout_s=cfg.asynchronous.manager_timeout_s,
    )
