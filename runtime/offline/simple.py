"""The simple format: a .jsonl file of {"prompt": "..."}, {"token_ids": [...]} (or "prompt_token_ids") or bare
JSON strings, or a .txt file with one prompt per line. Output rows carry the prompt's `index`:

    {"index": 0, "prompt": "...", "text": "...", "token_ids": [...], "finish_reason": "stop", "num_drafted": 8,
     "num_accepted": 6}
    {"index": 1, "line": 2, "error": {"code": "invalid_json", "message": "invalid JSON (Expecting value)"}}
"""

from __future__ import annotations

from typing import Any

from .reading import RowProblem, row_json, row_text
from .rows import RowError, RowJob, RowRequest, RowResult
from .source import RawRow

TOKEN_KEYS = ("prompt_token_ids", "token_ids")


class OutputMismatch(ValueError):
    """An existing output row that does not belong to this input (raised while checking a resume)."""


class SimpleFormat:
    name = "simple"

    def __init__(self, text: bool = False) -> None:
        self.text = text  # a .txt source: each row is a prompt string

    def parse(self, raw: RawRow) -> RowRequest | RowError:
        def error(code: str, message: str) -> RowError:
            return RowError(raw.index, raw.lineno, code, message)

        try:  # bounded: line length, and for JSON nesting depth and number lengths (reading.py)
            if self.text:
                return RowRequest(raw.index, raw.lineno, prompt=row_text(raw))
            value = row_json(raw)
        except RowProblem as problem:
            return error(problem.code, str(problem))
        if isinstance(value, str):
            return RowRequest(raw.index, raw.lineno, prompt=value)
        if not isinstance(value, dict):
            return error("invalid_request", f"expected an object or a string, got {type(value).__name__}")
        if "prompt" in value:
            if not isinstance(value["prompt"], str):
                return error("invalid_request", "'prompt' must be a string")
            return RowRequest(raw.index, raw.lineno, prompt=value["prompt"])
        for key in TOKEN_KEYS:
            if key in value:
                ids = value[key]
                if not (isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids)):
                    return error("invalid_request", f"'{key}' must be a non-empty list of non-negative ints")
                return RowRequest(raw.index, raw.lineno, prompt=tuple(ids))
        return error("invalid_request", "object has none of 'prompt', 'prompt_token_ids', 'token_ids'")

    def result_row(self, job: RowJob, result: RowResult, model: str, tokenizer: Any = None) -> dict[str, Any]:
        prompt = job.request.prompt
        return {
            "index": job.index,
            "prompt": prompt if isinstance(prompt, str) else None,
            "text": result.text,
            "token_ids": list(result.token_ids),
            "finish_reason": result.finish_reason,
            "num_drafted": result.num_drafted,
            "num_accepted": result.num_accepted,
        }

    def error_row(self, error: RowError) -> dict[str, Any]:
        return {"index": error.index, "line": error.lineno, "error": {"code": error.code, "message": error.message}}

    def failed(self, row: dict[str, Any]) -> bool:
        return row.get("error") is not None

    def check_resumed(self, row: dict[str, Any], expected: RowRequest | RowError | None, total: int) -> None:
        """Raise OutputMismatch unless `row` is the output row of input row `expected` (None: past the input)."""
        index = row.get("index")
        if type(index) is not int:
            raise OutputMismatch(f"'index' is {index!r}, not an integer: not a row of a specoffload output; "
                                 "cannot resume it")
        if index >= total or expected is None or index < 0:
            raise OutputMismatch(f"has a row for prompt {index}, but the input has {total} prompts: it was written "
                                 "for another input; use another --output")
        if index < expected.index:
            raise OutputMismatch(f"a second row for prompt {index} (duplicate index): cannot resume it")
        if index > expected.index:
            raise OutputMismatch(f"a row for prompt {index} where prompt {expected.index} was expected (rows missing "
                                 "or out of order): cannot resume it")
        text = row.get("prompt")
        want = getattr(expected, "prompt", None)
        if isinstance(text, str) and isinstance(want, str) and text != want:
            raise OutputMismatch(f"row {index} was written for a different prompt; use another --output")
