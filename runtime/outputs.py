"""Resumable JSONL output for offline corpora: rows are appended a chunk at a time and fsynced, and a rerun with
`resume=True` keeps the complete rows already written and reports which prompt indices are done.

A process killed mid-write leaves at most one partial last line; it is cut off on resume (its prompt is simply
generated again). Rows carry the prompt's `index` in the input file, so a resumed file holds every index once.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO


class OutputFileError(ValueError):
    """The output file cannot be used as asked (exists without --resume/--overwrite, or belongs to other input)."""


class JsonlSink:
    """Append-only JSONL rows to a file (or to stdout when `path` is None).

    resume: keep the complete rows of an existing file; `done` holds their indices. overwrite: replace an existing
    file. With neither, an existing non-empty file is an error: a finished run's output is never clobbered silently.
    """

    def __init__(self, path: Path | None, *, resume: bool = False, overwrite: bool = False) -> None:
        self.path = path
        self.done: dict[int, dict[str, Any]] = {}
        self._file: TextIO | None = None
        if path is None:
            return
        if resume and overwrite:
            raise OutputFileError("--resume and --overwrite exclude each other")
        if path.is_dir():
            raise OutputFileError(f"{path} is a directory, not an output file")
        exists = path.exists() and path.stat().st_size > 0
        if exists and not (resume or overwrite):
            raise OutputFileError(f"{path} already exists: pass --resume to continue it or --overwrite to replace it")
        path.parent.mkdir(parents=True, exist_ok=True)
        if exists and resume:
            self._read_existing(path)
        self._file = open(path, "a" if resume else "w", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def _read_existing(self, path: Path) -> None:
        data = path.read_bytes()
        keep = data.rfind(b"\n") + 1  # a partial last line (a kill mid-write) is dropped
        for lineno, line in enumerate(data[:keep].decode("utf-8", errors="strict").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                index = int(row["index"])
            except (ValueError, KeyError, TypeError):
                raise OutputFileError(f"{path}:{lineno}: not a row of a specoffload output; cannot resume it") from None
            self.done[index] = row
        if keep < len(data):
            with open(path, "r+b") as f:
                f.truncate(keep)

    def check_matches(self, prompts: list[Any]) -> None:
        """Refuse to resume a file written for other prompts (index out of range or a different prompt text)."""
        for index, row in self.done.items():
            if not 0 <= index < len(prompts):
                raise OutputFileError(f"{self.path} has a row for prompt {index}, but the input has {len(prompts)} "
                                      "prompts: it was written for another input; use another --output")
            text = row.get("prompt")
            if text is not None and isinstance(prompts[index], str) and text != prompts[index]:
                raise OutputFileError(f"{self.path}: row {index} was written for a different prompt; "
                                      "use another --output")

    def forget(self, indices: Iterable[int]) -> None:
        """Drop the rows of `indices` from a resumed file (rewritten atomically) so they can be generated again."""
        drop = set(indices) & set(self.done)
        if not drop or self.path is None or self._file is None:
            return
        for index in drop:
            del self.done[index]
        self._file.close()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(json.dumps(self.done[i], ensure_ascii=False) + "\n" for i in sorted(self.done)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, rows: Iterable[dict[str, Any]]) -> None:
        """Append rows as one write, flushed and fsynced: after this returns they survive a crash."""
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        if self._file is None:
            sys.stdout.write(text)
            sys.stdout.flush()
            return
        self._file.write(text)
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> JsonlSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
