"""`RunSummary`: what one run reports (``summary.json``, the final table, the exit status)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles.training.evaluate import EvalResult


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "output_dir": self.output_dir,
            "steps_done": self.steps_done,
            "seconds": self.seconds,
            "broken": self.broken,
            "stopped": self.stopped,
            "evals": {stage: {m: r.to_dict() for m, r in res.items()} for stage, res in self.evals.items()},
        }
