"""Crash-safe, append-only JSONL recording of sessions, and its reader.

Each record is encoded to one complete line and written with a single `os.write` on an `O_APPEND`
descriptor, then fsync'ed (per line or per batch). A killed writer therefore leaves only complete lines,
plus at most one torn last line, which the reader skips and reports.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.sessions.records import SessionRecord, jsonable


class RecorderError(RuntimeError):
    """A record could not be written (closed recorder, full disk, unwritable path)."""


def encode_record(record: SessionRecord | dict[str, Any]) -> str:
    """One JSON line (with its newline). Never contains a raw newline inside."""
    data = record.to_dict() if isinstance(record, SessionRecord) else record
    try:
        return json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n"
    except (TypeError, ValueError):  # a non-JSON value or a non-finite float somewhere: sanitise everything
        return json.dumps(jsonable(data), ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n"


class Recorder:
    """Appends `SessionRecord`s to `path` (created with its parent folders).

    `fsync` is "batch" (one fsync per group of lines written together: the default), "line" or "none".
    `append` (async) groups concurrent records into one write and returns once its line is on disk;
    `write` (sync) writes one line now. `count` is the number of lines written by this recorder.
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: str = "batch") -> None:
        if fsync not in ("batch", "line", "none"):
            raise ValueError(f"fsync must be 'batch', 'line' or 'none', got {fsync!r}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        try:
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise RecorderError(f"cannot open {self.path} for appending: {exc}") from exc
        self._pending: list[tuple[str, asyncio.Future[None]]] = []
        self._drainer: asyncio.Task[None] | None = None
        self.count = 0

    def _write_lines(self, lines: list[str]) -> None:
        if self._fd is None:
            raise RecorderError(f"recorder for {self.path} is closed")
        if self._fsync == "line":
            for line in lines:
                self._write_all(line.encode())
                os.fsync(self._fd)
        else:
            self._write_all("".join(lines).encode())
            if self._fsync == "batch":
                os.fsync(self._fd)
        self.count += len(lines)

    def _write_all(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]

    def write(self, record: SessionRecord | dict[str, Any]) -> None:
        """Write one record now (blocking), durable on return."""
        try:
            self._write_lines([encode_record(record)])
        except OSError as exc:
            raise RecorderError(f"writing {self.path} failed: {exc}") from exc

    async def append(self, record: SessionRecord | dict[str, Any]) -> None:
        """Queue one record; returns when it is written. Cancelling the caller does not drop the line."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._pending.append((encode_record(record), fut))
        if self._drainer is None or self._drainer.done():
            self._drainer = loop.create_task(self._drain())
        await asyncio.shield(fut)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                await loop.run_in_executor(None, self._write_lines, [line for line, _ in batch])
            except Exception as exc:  # report to every waiter, keep the loop alive
                err = exc if isinstance(exc, RecorderError) else RecorderError(f"writing {self.path}: {exc}")
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(err)
                continue
            for _, fut in batch:
                if not fut.done():
                    fut.set_result(None)

    async def aclose(self) -> None:
        """Wait for queued records, then close."""
        while self._drainer is not None and not self._drainer.done():
            await asyncio.shield(self._drainer)
        self.close()

    def close(self) -> None:
        """Close the file. Idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class BadLine:
    """A line the reader skipped: its 1-based number, byte offset, why, and whether it is the torn tail."""

    line_no: int
    offset: int
    reason: str
    torn_tail: bool


@dataclass
class ReadResult:
    """The records of a file, and the lines that were skipped."""

    records: list[SessionRecord] = field(default_factory=list)
    bad_lines: list[BadLine] = field(default_factory=list)

    @property
    def torn_tail(self) -> BadLine | None:
        return next((b for b in self.bad_lines if b.torn_tail), None)


def iter_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, int, dict[str, Any] | BadLine]]:
    """Yield `(line_no, offset, parsed dict or BadLine)` for every non-empty line of `path`.

    A last line without its newline is torn: a writer died while appending it.
    """
    with open(path, "rb") as f:
        offset = 0
        for line_no, raw in enumerate(f, start=1):
            start, offset = offset, offset + len(raw)
            complete = raw.endswith(b"\n")
            if not raw.strip():
                continue
            try:
                data = json.loads(raw)
                if not isinstance(data, dict):
                    raise ValueError(f"a JSON {type(data).__name__}, not an object")
            except (ValueError, UnicodeDecodeError) as exc:
                yield line_no, start, BadLine(line_no, start, f"unparseable: {exc}", torn_tail=not complete)
                continue
            if not complete:
                yield line_no, start, BadLine(line_no, start, "no trailing newline", torn_tail=True)
                continue
            yield line_no, start, data


def read_sessions(path: str | os.PathLike[str]) -> ReadResult:
    """Read every complete record of a `sessions.jsonl`; skipped lines are listed in `bad_lines`."""
    out = ReadResult()
    for line_no, offset, item in iter_lines(path):
        if isinstance(item, BadLine):
            out.bad_lines.append(item)
            continue
        try:
            out.records.append(SessionRecord.from_dict(item))
        except (KeyError, TypeError, ValueError) as exc:
            out.bad_lines.append(BadLine(line_no, offset, f"not a session record: {exc}", torn_tail=False))
    return out
