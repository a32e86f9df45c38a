"""Crash-safe, append-only JSONL recording of sessions, and its reader.

Each record is encoded to one complete line and written with a single `os.write` on an `O_APPEND`
descriptor, then fsync'ed (per line, or per batch in the background). A killed writer therefore leaves only
complete lines, plus at most one torn last line (a write cut short), which the reader skips and reports.
A `Recorder` reopening such a file first repairs it (`repair_tail`), so its next record starts on a line of
its own; a resumed run moves the records of the sessions it will redo aside (`Recorder.drop_after`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.sessions.records import SessionRecord, jsonable

log = logging.getLogger(__name__)

#: Sidecar files next to a recording: bytes of a torn last line, and records dropped on resume.
TORN_SUFFIX = ".torn"
DROPPED_SUFFIX = ".dropped"


class RecorderError(RuntimeError):
    """A record could not be written (closed recorder, full disk, unwritable path)."""


def _sidecar(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _append_durably(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _last_line_start(f: Any, size: int, chunk: int = 1 << 16) -> int:
    """The offset just after the last newline of an open binary file of `size` bytes (0 if none)."""
    end = size
    while end > 0:
        start = max(0, end - chunk)
        f.seek(start)
        pos = f.read(end - start).rfind(b"\n")
        if pos >= 0:
            return start + pos + 1
        end = start
    return 0


def repair_tail(path: str | os.PathLike[str]) -> int:
    """Make `path` end with a complete line, so appending to it starts a new line.

    A last line without its newline (a writer killed mid-write) is repaired when it is a whole JSON object
    (only the newline was lost): the newline is added. Otherwise its bytes are moved to `<path>.torn`
    (appended, one fragment per line) and the file is cut before them. Returns how many bytes were moved.
    """
    path = Path(path)
    if not path.exists():
        return 0
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        start = _last_line_start(f, size)
        f.seek(start)
        tail = f.read(size - start)
        try:
            whole = isinstance(json.loads(tail), dict)
        except ValueError:
            whole = False
        if whole:
            f.seek(size)
            f.write(b"\n")
            f.flush()
            os.fsync(f.fileno())
            log.warning("%s: added the missing newline after its last record", path)
            return 0
        _append_durably(_sidecar(path, TORN_SUFFIX), tail + b"\n")
        f.truncate(start)
        f.flush()
        os.fsync(f.fileno())
    log.warning(
        "%s: moved a torn last line (%d bytes at offset %d) to %s",
        path,
        len(tail),
        start,
        _sidecar(path, TORN_SUFFIX).name,
    )
    return len(tail)


def encode_record(record: SessionRecord | dict[str, Any]) -> str:
    """One JSON line (with its newline) that encodes as UTF-8. Never contains a raw newline inside.

    Text that UTF-8 cannot hold (a lone surrogate such as `\\ud800` from model output) is written as a JSON
    escape, which reads back to the same string."""
    data = record.to_dict() if isinstance(record, SessionRecord) else record
    try:
        line = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n"
    except (TypeError, ValueError):  # a non-JSON value or a non-finite float somewhere: sanitise everything
        data = jsonable(data)
        line = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n"
    try:
        line.encode()
    except UnicodeEncodeError:
        line = json.dumps(data, ensure_ascii=True, separators=(",", ":"), allow_nan=False) + "\n"
    return line


class Recorder:
    """Appends `SessionRecord`s to `path` (created with its parent folders).

    Every record is written at once as one complete line (`os.write` on an `O_APPEND` descriptor), so a
    killed process leaves only complete lines. `fsync` adds durability against a machine crash:
    "line" fsyncs after every line, "batch" (default) fsyncs in the background at most every
    `fsync_interval_s` (group commit, off the event loop), "none" leaves it to the OS. `count` is the number
    of lines written.

    Opening an existing file first repairs a torn last line (`repair_tail`; `torn_bytes` says how many
    bytes went to the `.torn` sidecar), so the first record appended is whole.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, fsync: str = "batch", fsync_interval_s: float = 0.2
    ) -> None:
        if fsync not in ("batch", "line", "none"):
            raise ValueError(f"fsync must be 'batch', 'line' or 'none', got {fsync!r}")
        if fsync_interval_s < 0:
            raise ValueError("fsync_interval_s must be >= 0")
        self.path = Path(path)
        self._fsync = fsync
        self._interval = fsync_interval_s
        self._fd: int | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.torn_bytes = repair_tail(self.path)
        except OSError as exc:
            raise RecorderError(f"cannot repair the end of {self.path}: {exc}") from exc
        self._open()
        self._dirty = False
        self._syncer: asyncio.Task[None] | None = None
        self.count = 0

    def _open(self) -> None:
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise RecorderError(f"cannot open {self.path} for appending: {exc}") from exc

    def drop_after(self, timestamp: float) -> int:
        """Move the records of sessions that started after `timestamp` to `<path>.dropped`; returns how many.

        A run resumed from a checkpoint saved at `timestamp` (`time.time()`) redoes those sessions; moving
        the first tries aside keeps every session in the file once, and loses nothing. Call it before
        appending (with no append in flight); the file is rewritten atomically.
        """
        if self._fd is None:
            raise RecorderError(f"recorder for {self.path} is closed")
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        try:
            return self._move_records_after(timestamp)
        except OSError as exc:
            raise RecorderError(f"dropping records after {timestamp} from {self.path} failed: {exc}") from exc
        finally:
            self._open()

    def _move_records_after(self, timestamp: float) -> int:
        tmp = self.path.with_name(self.path.name + ".tmp")
        dropped: list[bytes] = []
        with open(self.path, "rb") as src, open(tmp, "wb") as dst:
            for raw in src:
                try:
                    started = json.loads(raw).get("started_at")
                except (ValueError, AttributeError):
                    started = None  # not a record: keep the line as it is
                if isinstance(started, int | float) and started > timestamp:
                    dropped.append(raw)
                else:
                    dst.write(raw)
            dst.flush()
            os.fsync(dst.fileno())
        if not dropped:
            tmp.unlink()
            return 0
        _append_durably(_sidecar(self.path, DROPPED_SUFFIX), b"".join(dropped))  # first: nothing can be lost
        os.replace(tmp, self.path)
        _fsync_dir(self.path)
        log.info(
            "%s: moved %d records of sessions started after %.3f to %s",
            self.path,
            len(dropped),
            timestamp,
            _sidecar(self.path, DROPPED_SUFFIX).name,
        )
        return len(dropped)

    def _write_line(self, line: str) -> None:
        if self._fd is None:
            raise RecorderError(f"recorder for {self.path} is closed")
        data = line.encode()
        try:
            n = os.write(self._fd, data)
            if n != len(data):  # a short write (full disk): finish the line so the file stays line-aligned
                view = memoryview(data)[n:]
                while view:
                    view = view[os.write(self._fd, view) :]
            if self._fsync == "line":
                os.fsync(self._fd)
        except OSError as exc:
            raise RecorderError(f"writing {self.path} failed: {exc}") from exc
        self.count += 1

    def write(self, record: SessionRecord | dict[str, Any]) -> None:
        """Write one record now (blocking). With fsync="batch" outside an event loop it is fsync'ed at once."""
        self._write_line(encode_record(record))
        if self._fsync == "batch":
            assert self._fd is not None
            os.fsync(self._fd)

    async def append(self, record: SessionRecord | dict[str, Any]) -> None:
        """Write one record now; with fsync="batch" a background fsync follows within `fsync_interval_s`."""
        self._write_line(encode_record(record))
        if self._fsync == "batch":
            self._dirty = True
            if self._syncer is None or self._syncer.done():
                self._syncer = asyncio.get_running_loop().create_task(self._sync_loop())

    async def _sync_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self._dirty and self._fd is not None:
            await asyncio.sleep(self._interval)
            self._dirty = False
            fd = self._fd
            if fd is not None:
                await loop.run_in_executor(None, os.fsync, fd)

    async def flush(self) -> None:
        """Make every line written so far durable."""
        if self._syncer is not None and not self._syncer.done():
            await asyncio.shield(self._syncer)
        if self._fd is not None and self._fsync != "none":
            await asyncio.get_running_loop().run_in_executor(None, os.fsync, self._fd)
            self._dirty = False

    async def aclose(self) -> None:
        """fsync what was written, then close."""
        await self.flush()
        self.close()

    def close(self) -> None:
        """Close the file (fsync'ed unless fsync="none"). Idempotent."""
        if self._fd is not None:
            if self._fsync != "none":
                os.fsync(self._fd)
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
