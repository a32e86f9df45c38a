"""The rollout manager of the asynchronous loop as a Ray actor (`cluster.kind: ray`, `async.enabled`).

`RolloutManagerActor` runs the rollout process's own body (`rollout_main`: the `RolloutManager` with its
scheduler, router and recorder, against the engine actors' URLs) in a thread, with two in-actor queues in
place of the process's `torch.multiprocessing` queues. `ActorLink` is the trainer's `RolloutLink` to it, so the
trainer drives it through the same `RolloutHandle` as a child process.
"""

from __future__ import annotations

import os
import queue
from typing import Any

from miles.training.cluster.config import enter_driver_folder
from miles.training.config import TrainConfig
from miles.training.rollout_process import RolloutStart, rollout_main


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


class ActorLink:
    """`RolloutLink` to a manager in a `RolloutManagerActor`: messages through the actor's two queues, and the
    actor's `run` call as the manager's life (its status, or 1 when the actor died)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.run = actor.run.remote()

    @classmethod
    def start(cls, cfg: TrainConfig, start: RolloutStart) -> ActorLink:
        """Start `rollout_main` in a `RolloutManagerActor`, placed by `cluster.manager`."""
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
        return cls(actor)

    def send(self, message: Any) -> None:
        import ray

        ray.get(self.actor.put.remote(message))  # waited for: the manager sees messages in the order sent

    def receive(self, timeout_s: float) -> Any | None:
        import ray

        try:
            return ray.get(self.actor.take.remote(timeout_s))
        except ray.exceptions.RayActorError:
            return None  # the actor is gone: `exit_code` says so

    def waiting(self) -> int:
        import ray

        try:
            return int(ray.get(self.actor.qsize.remote()))
        except ray.exceptions.RayActorError:
            return 0

    def exit_code(self) -> int | None:
        import ray

        ready, _ = ray.wait([self.run], timeout=0)
        if not ready:
            return None
        try:
            return int(ray.get(self.run))
        except ray.exceptions.RayError:
            return 1

    def wait_exit(self, timeout_s: float) -> None:
        import ray

        ray.wait([self.run], timeout=timeout_s)

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    def release(self) -> None:
        self.kill()  # its manager has returned; the actor holds the CPUs `cluster.manager` reserved
