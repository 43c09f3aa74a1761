"""Every prompt of a small prompt file, in memory (for `specoffload plan`), parsed as a job parses its rows."""

from __future__ import annotations

import os

from ..prompts import Prompt, PromptFileError
from .formats import input_format
from .rows import RowError
from .source import InputSource


def read_prompts_file(path: str | os.PathLike[str]) -> list[Prompt]:
    """Read every prompt of a ``.jsonl`` or ``.txt`` file into a list (for a handful: `specoffload plan`; a job
    streams its input instead: job.py).

    ``.jsonl``: one JSON value per non-blank line: an object with ``"prompt"`` (string) or
    ``"prompt_token_ids"`` / ``"token_ids"`` (list of ints), or a bare JSON string.
    ``.txt`` (or any other suffix): one prompt per line, blank lines skipped. An OpenAI batch file's
    ``/v1/completions`` requests give their ``body.prompt`` (chat requests are refused: they need the chat template).
    Lines end at "\n" only (form feed, U+2028 and the like are text). Raises :class:`PromptFileError` naming the
    file (and line number) for anything malformed.
    """
    source = InputSource.file(path)
    fmt = input_format(source)
    prompts: list[Prompt] = []
    for raw in source.rows():
        row = fmt.parse(raw)
        if isinstance(row, RowError):
            raise PromptFileError(f"{source.where(row.lineno)}: {row.message}")
        if row.prompt is None:
            raise PromptFileError(f"{source.where(row.lineno)}: a chat request; give prompts (a simple prompt file "
                                  "or /v1/completions requests)")
        prompts.append(row.prompt if isinstance(row.prompt, str) else list(row.prompt))
    if not prompts:
        raise PromptFileError(f"{source.name}: no prompts in file")
    return prompts
