"""The output file of a job: one JSON row per input row, in input order, appended a chunk at a time and fsynced.

Safety, in order of what can go wrong:
  * Two runs on one output: the file is locked (flock, exclusive) for the whole job; a second run fails at once.
  * A finished output is never clobbered: an existing non-empty file needs --resume or --overwrite.
  * A crash mid-write leaves at most one partial last line; resume drops it. A failed write (disk full) is cut
    back to the last whole chunk on the spot, so the file only ever holds whole rows.
  * Resume checks the manifest (manifest.py), then every complete row against the input row it stands for
    (format.check_resumed: index or custom_id), reading rows with "\\n" as the only separator, and cuts the file in
    place (ftruncate) back to the last whole chunk. Nothing is rewritten or renamed: no temporary file, and no
    other process's file is orphaned.

Rows are written as UTF-8 JSON with U+2028, U+2029 and U+0085 escaped, so a reader splitting on any line break
still sees one row per line.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .formats import Format
from .manifest import Manifest, manifest_path, read_manifest, write_manifest
from .rows import RowError, RowRequest
from .simple import OutputMismatch

_LINE_BREAKS = {"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"}


class OutputFileError(ValueError):
    """The output cannot be used as asked (exists without --resume/--overwrite, locked, belongs to another job)."""


def dump_row(row: dict[str, Any]) -> str:
    text = json.dumps(row, ensure_ascii=False)
    for char, escape in _LINE_BREAKS.items():
        if char in text:
            text = text.replace(char, escape)
    return text + "\n"


@dataclass(frozen=True)
class Resumed:
    """What resume keeps: `rows` whole chunks' rows (`failed` of them error rows); `dropped` rows of an unfinished
    chunk that will be generated again."""

    rows: int = 0
    failed: int = 0
    dropped: int = 0


class OutputFile:
    """A job's output file, locked from construction to `close`. See the module docstring."""

    def __init__(self, path: Path, *, resume: bool = False, overwrite: bool = False) -> None:
        if resume and overwrite:
            raise OutputFileError("--resume and --overwrite exclude each other")
        if path.is_dir():
            raise OutputFileError(f"{path} is a directory, not an output file")
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise OutputFileError(f"{path} is being written by another specoffload run (it holds the file's lock): "
                                  "wait for it to finish, or use another --output") from None
        self.size = os.fstat(self.fd).st_size
        if self.size > 0 and not (resume or overwrite):
            self.close()
            raise OutputFileError(f"{path} already exists: pass --resume to continue it or --overwrite to replace it")
        self.resuming = resume and self.size > 0

    def start(self, manifest: Manifest) -> None:
        """Resuming: refuse a manifest that differs. Otherwise: empty the file and write the manifest."""
        mpath = manifest_path(self.path)
        if self.resuming:
            difference = manifest.first_difference(read_manifest(mpath))
            if difference is not None:
                raise OutputFileError(f"--resume refused: {self.path} was written by another job ({difference}); "
                                      "rerun with the same input, models and settings, or use another --output")
            return
        os.ftruncate(self.fd, 0)
        self.size = 0
        write_manifest(mpath, manifest)

    def resume(self, fmt: Format, expected: Iterator[RowRequest | RowError], total: int, chunk_size: int) -> Resumed:
        """Check the complete rows against the input rows they stand for, in step, and cut the file back to the last
        whole chunk (all of it when every row is there)."""
        if not self.resuming:
            return Resumed()
        rows = failed = 0
        cut = (0, 0, 0)  # (rows, failed, byte offset) at the last chunk boundary
        offset = 0
        with open(self.path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.endswith(b"\n"):
                    break  # a partial last line (killed mid-write): dropped
                offset += len(line)
                where = f"{self.path}:{lineno}"
                try:
                    row = json.loads(line)
                except ValueError:
                    raise OutputFileError(f"{where}: not a row of a specoffload output; cannot resume it") from None
                if not isinstance(row, dict):
                    raise OutputFileError(f"{where}: not a row of a specoffload output; cannot resume it")
                try:
                    fmt.check_resumed(row, next(expected, None), total)
                except OutputMismatch as err:
                    raise OutputFileError(f"{where}: {err}") from None
                rows += 1
                failed += fmt.failed(row)
                if rows % chunk_size == 0 or rows == total:
                    cut = (rows, failed, offset)
        if cut[2] < self.size:
            os.ftruncate(self.fd, cut[2])
            os.fsync(self.fd)
            self.size = cut[2]
        return Resumed(rows=cut[0], failed=cut[1], dropped=rows - cut[0])

    def append(self, rows: Iterable[dict[str, Any]]) -> None:
        """Append rows as one write, fsynced: after this returns they survive a crash. A failed write is cut back."""
        data = "".join(dump_row(r) for r in rows).encode("utf-8")
        try:
            view, at = memoryview(data), self.size
            while view:
                n = os.pwrite(self.fd, view, at)
                view, at = view[n:], at + n
            os.fsync(self.fd)
        except OSError as err:
            with contextlib.suppress(OSError):  # else a partial last line is dropped on resume anyway
                os.ftruncate(self.fd, self.size)
            raise OutputFileError(f"writing {self.path}: {err.strerror or err}; the rows before this chunk are safe "
                                  "in it: make room and rerun with --resume") from None
        self.size += len(data)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the lock
            self.fd = -1

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StdoutOutput:
    """Rows to stdout (no --output): nothing to lock, resume or describe."""

    resuming = False

    def start(self, manifest: Manifest) -> None:
        pass

    def resume(self, fmt: Format, expected: Iterator[RowRequest | RowError], total: int, chunk_size: int) -> Resumed:
        return Resumed()

    def append(self, rows: Iterable[dict[str, Any]]) -> None:
        sys.stdout.write("".join(dump_row(r) for r in rows))
        sys.stdout.flush()

    def close(self) -> None:
        pass
