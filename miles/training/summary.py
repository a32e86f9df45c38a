"""`RunSummary`: what one run reports (``summary.json``, the final table, the exit status)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles.training.evaluate import EvalResult

if TYPE_CHECKING:
    from miles.training.placement import RunPlacement


@dataclass
class RunSummary:
    """The outcome of one run: held-out results at each stage, and where the time went."""

    output_dir: str
    steps_done: int
    evals: dict[str, dict[str, EvalResult]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    #: Why the run stopped before its budget because it was broken (empty when it was not): the run then
    #: reports this line and exit status 3, never a score.
    broken: str = ""
    #: The signal that stopped the run ("SIGINT", "SIGTERM"), or "": it checkpointed and reports no score.
    stopped: str = ""
    #: Where each role ran.
    placement: RunPlacement | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "output_dir": self.output_dir,
            "steps_done": self.steps_done,
            "seconds": self.seconds,
            "broken": self.broken,
            "stopped": self.stopped,
            "placement": dataclasses.asdict(self.placement) if self.placement else None,
            "evals": {stage: {m: r.to_dict() for m, r in res.items()} for stage, res in self.evals.items()},
        }
