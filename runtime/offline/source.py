"""Where a job's rows come from: a prompt file read line by line, the bundled HumanEval prompts, or a corpus.

Lines are split on b"\\n" only (a "\\r" before it is dropped): form feed, U+2028, U+2029, U+0085 and the other
characters `str.splitlines()` also breaks on are text inside a row. A row is a line that is not blank (ASCII
whitespace only); its `index` counts rows from 0, its line number counts lines from 1. Nothing is read into memory
beyond one line at a time.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..prompts import PromptFileError, humaneval_prompts


@dataclass(frozen=True)
class RawRow:
    index: int  # position among the rows, from 0
    lineno: int  # line in the file, from 1
    data: bytes  # the line without its "\n"


@dataclass(frozen=True)
class InputSource:
    """A prompt file (`path`) or prompts held in memory (`lines`: HumanEval, a --dataset corpus). `text`: each row
    is a prompt string (a .txt file), not JSON."""

    name: str
    path: Path | None = None
    lines: tuple[bytes, ...] = ()
    text: bool = False

    @classmethod
    def file(cls, path: str | Path) -> InputSource:
        p = Path(path)
        if not p.is_file():
            raise PromptFileError(f"{p}: cannot read prompt file: " + ("a directory" if p.is_dir() else "no such file"))
        try:
            with open(p, "rb"):
                pass
        except OSError as err:
            raise PromptFileError(f"{p}: cannot read prompt file: {err}") from None
        return cls(name=str(p), path=p, text=p.suffix.lower() != ".jsonl")

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

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        if self.path is None:
            yield from enumerate(self.lines, 1)
            return
        try:
            with open(self.path, "rb") as f:
                for lineno, line in enumerate(f, 1):  # a binary file's lines end at b"\n" only
                    yield lineno, line.removesuffix(b"\n").removesuffix(b"\r")
        except OSError as err:
            raise PromptFileError(f"{self.name}: cannot read prompt file: {err}") from None

    def rows(self, start: int = 0) -> Iterator[RawRow]:
        """Every row from index `start` on (rows before it are counted, not kept)."""
        index = 0
        for lineno, line in self._lines():
            if not line.strip():
                continue
            if index >= start:
                yield RawRow(index, lineno, line)
            index += 1

    def identity(self) -> tuple[str, int]:
        """(SHA-256 of the content, number of rows), streamed."""
        digest = hashlib.sha256()
        rows = 0
        if self.path is None:
            for line in self.lines:
                digest.update(line + b"\n")
                rows += bool(line.strip())
            return digest.hexdigest(), rows
        try:
            with open(self.path, "rb") as f:
                for line in f:
                    digest.update(line)
                    rows += bool(line.strip())
        except OSError as err:
            raise PromptFileError(f"{self.name}: cannot read prompt file: {err}") from None
        return digest.hexdigest(), rows

    def where(self, lineno: int) -> str:
        return f"{self.name}:{lineno}"
