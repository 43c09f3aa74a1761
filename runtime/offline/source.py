"""Where a job's rows come from: a prompt file read line by line, the bundled HumanEval prompts, or a corpus.

Lines are split on b"\\n" only (a "\\r" before it is dropped): form feed, U+2028, U+2029, U+0085 and the other
characters `str.splitlines()` also breaks on are text inside a row. A row is a line that is not blank (ASCII
whitespace only); its `index` counts rows from 0, its line number counts lines from 1. Nothing is read into memory
beyond one line at a time, and no line beyond `max_line_bytes` (default `MAX_LINE_BYTES`): a longer line is read
in bounded pieces and dropped as it is read (hashed, never held); its row keeps its first `HEAD_BYTES` bytes (for the
custom_id of its error row) and its length, and becomes a `line_too_long` error row.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..prompts import PromptFileError, humaneval_prompts

#: the longest input line read (bytes, without its newline); a longer one becomes an error row, never held in memory
MAX_LINE_BYTES = 16 << 20
#: what an over-long line keeps of its start (its custom_id, for the error row)
HEAD_BYTES = 4096
_PIECE = 1 << 20  # an over-long line is skipped in pieces of this many bytes
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark: skipped at the start of a prompt file


@dataclass(frozen=True)
class RawRow:
    index: int  # position among the rows, from 0
    lineno: int  # line in the file, from 1
    data: bytes  # the line without its "\n" (of an over-long line: its first HEAD_BYTES bytes)
    too_long: tuple[int, int] | None = None  # an over-long line: (its length, the limit) in bytes; data is its head


@dataclass(frozen=True)
class InputSource:
    """A prompt file (`path`) or prompts held in memory (`lines`: HumanEval, a --dataset corpus). `text`: each row
    is a prompt string (a .txt file), not JSON."""

    name: str
    path: Path | None = None
    lines: tuple[bytes, ...] = ()
    text: bool = False
    max_line_bytes: int = MAX_LINE_BYTES

    @classmethod
    def file(cls, path: str | Path, max_line_bytes: int = MAX_LINE_BYTES) -> InputSource:
        p = Path(path)
        if not p.is_file():
            raise PromptFileError(f"{p}: cannot read prompt file: " + ("a directory" if p.is_dir() else "no such file"))
        try:
            with open(p, "rb"):
                pass
        except OSError as err:
            raise PromptFileError(f"{p}: cannot read prompt file: {err}") from None
        return cls(name=str(p), path=p, text=p.suffix.lower() != ".jsonl", max_line_bytes=max_line_bytes)

    @classmethod
    def dataset(cls, spec: str) -> InputSource:
        """A corpus of runtime/corpora.py: "NAME[:start[:end]]" (DatasetError, one line, when unavailable)."""
        from ..corpora import dataset_prompts

        prompts = dataset_prompts(spec)
        return cls(name=spec, lines=tuple(json.dumps({"prompt": p}).encode() for p in prompts))

    @classmethod
    def humaneval(cls, n: int | None) -> InputSource:
        prompts = humaneval_prompts(n or None)
        return cls(name="humaneval", lines=tuple(json.dumps({"prompt": p}).encode() for p in prompts))

    def _lines(self, digest: Any = None) -> Iterator[tuple[int, bytes, tuple[int, int] | None]]:
        """(line number, the line without its newline, None) per line; an over-long line gives (line number, its
        head, its length) and is read in pieces, never whole. `digest`: fed every byte of the file."""
        if self.path is None:
            for lineno, line in enumerate(self.lines, 1):
                if digest is not None:
                    digest.update(line + b"\n")
                yield lineno, line, None
            return
        limit = self.max_line_bytes
        try:
            with open(self.path, "rb") as f:
                lineno = 0
                while line := f.readline(limit + 2):  # a binary file's lines end at b"\n" only
                    lineno += 1
                    if digest is not None:
                        digest.update(line)
                    if lineno == 1 and line.startswith(BOM):  # a UTF-8 byte-order mark (Windows editors) is no text
                        line = line[len(BOM):]
                    if line.endswith(b"\n") or len(line) <= limit:
                        body = line.removesuffix(b"\n").removesuffix(b"\r")
                        if len(body) <= limit:
                            yield lineno, body, None
                            continue
                    head, length = self._skip(f, line, digest)
                    yield lineno, head, (length, limit)
        except OSError as err:
            raise PromptFileError(f"{self.name}: cannot read prompt file: {err}") from None

    @staticmethod
    def _skip(f: Any, start: bytes, digest: Any) -> tuple[bytes, int]:
        """The rest of an over-long line that began with `start`, read in pieces: (its head, its length)."""
        head, length, piece = start[:HEAD_BYTES], len(start), start
        while not piece.endswith(b"\n") and (piece := f.readline(_PIECE)):
            length += len(piece)
            if digest is not None:
                digest.update(piece)
        return head, length - int(piece.endswith(b"\n"))

    def rows(self, start: int = 0) -> Iterator[RawRow]:
        """Every row from index `start` on (rows before it are counted, not kept)."""
        index = 0
        for lineno, line, too_long in self._lines():
            if too_long is None and not line.strip():
                continue
            if index >= start:
                yield RawRow(index, lineno, line, too_long)
            index += 1

    def identity(self) -> tuple[str, int]:
        """(SHA-256 of the content, number of rows), streamed (an over-long line counts as a row)."""
        digest = hashlib.sha256()
        rows = sum(too_long is not None or bool(line.strip()) for _, line, too_long in self._lines(digest))
        return digest.hexdigest(), rows

    def where(self, lineno: int) -> str:
        return f"{self.name}:{lineno}"
