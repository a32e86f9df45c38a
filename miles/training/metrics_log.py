"""The run's metrics log: one JSON object per line, flushed as it is written."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class MetricsLog:
    """Append-only JSONL metrics: `{"kind": ..., "step": ..., "time": ..., **values}` per line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._f = self.path.open("a", encoding="utf-8")

    def write(self, kind: str, step: int, **values: Any) -> None:
        row = {"kind": kind, "step": int(step), "time": time.time(), **values}
        self._f.write(json.dumps(row, default=float) + "\n")
        self._f.flush()

    def drop_after(self, timestamp: float) -> None:
        """Forget the rows written after `timestamp`: a run resumed from a checkpoint redoes that work."""
        self._f.close()
        rows = [r for r in read_metrics(self.path) if r["time"] <= timestamp]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, default=float) + "\n" for r in rows), encoding="utf-8")
        tmp.replace(self.path)
        self._f = self.path.open("a", encoding="utf-8")

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every complete row of a metrics log (a torn last line is skipped)."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
