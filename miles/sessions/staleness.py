"""`StalenessBound`: `async.max_staleness`, the whole rule in one place, for both sides of the asynchronous loop
(the rollout process admits groups by it, `miles.training.async_rollout.ProcessSource` takes them by it).

A group's staleness is the trainer's weight version minus the oldest version among its generated tokens (the
largest over its samples). With `groups_per_version` groups trained per version, group number `g` (in start
order, counting from the first version the engines held) starts only once the engines hold version
`first_version + g // groups_per_version - max_staleness`; the trainer takes groups in start order and waits
for a running group that would be over the bound at its next version, so no group is trained more than
`max_staleness` versions after it started. A group over it all the same (HTTP engines whose versions lag) is
turned away.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from miles.sessions.records import SessionRecord


@dataclass(frozen=True)
class StalenessBound:
    """At most `max_staleness` versions between a group's oldest token and the trainer that trains it, with
    `groups_per_version` groups trained per version."""

    max_staleness: int
    groups_per_version: int

    def __post_init__(self) -> None:
        if self.groups_per_version < 1 or self.max_staleness < 0:
            raise ValueError("groups_per_version must be >= 1 and max_staleness >= 0")

    def admitted(self, engine_version: int, first_version: int, credit: int = 0) -> int:
        """How many groups may have started once the engines hold `engine_version`, counting from
        `first_version`, plus `credit` places freed by groups that trained nothing or were turned away."""
        return (engine_version - first_version + self.max_staleness + 1) * self.groups_per_version + credit

    @staticmethod
    def staleness(records: Sequence[SessionRecord], trainer_version: int) -> int:
        """The most stale sample of a group: trainer version minus its oldest generating version (0 if
        unknown)."""
        known = [v for v in (r.trajectory.oldest_weight_version for r in records) if v is not None]
        return max((trainer_version - v for v in known), default=0)

    def too_stale(self, records: Sequence[SessionRecord], trainer_version: int) -> bool:
        """Whether a finished group is over the bound for a trainer at `trainer_version` (turned away)."""
        return self.staleness(records, trainer_version) > self.max_staleness

    def due(self, records: Sequence[SessionRecord], trainer_version: int) -> bool:
        """Whether a finished group would be over the bound at the trainer's next version: it trains now, as a
        late group, rather than wait."""
        return self.staleness(records, trainer_version) == self.max_staleness

    def must_wait(self, oldest_running: int | None, trainer_version: int) -> bool:
        """Whether a step must wait for a running group admitted at engine version `oldest_running` (None:
        none runs), since it may be over the bound at the trainer's next version."""
        return oldest_running is not None and trainer_version - oldest_running >= self.max_staleness
