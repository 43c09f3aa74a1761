"""Which format a job's input is in: the simple format or the OpenAI Batch API format (output follows input)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from .openai import OpenAIBatchFormat
from .reading import RowProblem, head_custom_id, row_json
from .rows import RowError, RowJob, RowRequest, RowResult
from .simple import SimpleFormat
from .source import InputSource, RawRow

FORMATS = ("auto", "simple", "openai")


class Format(Protocol):
    name: str

    def parse(self, raw: RawRow) -> RowRequest | RowError: ...
    def result_row(self, job: RowJob, result: RowResult | Sequence[RowResult], model: str,
                   tokenizer: Any = None) -> dict[str, Any]: ...
    def error_row(self, error: RowError) -> dict[str, Any]: ...
    def failed(self, row: dict[str, Any]) -> bool: ...
    def check_resumed(self, row: dict[str, Any], expected: RowRequest | RowError | None, total: int) -> None: ...


def input_format(source: InputSource, requested: str = "auto") -> Format:
    """`requested`, or for "auto": OpenAI batch when the first row is an object with custom_id, url or body."""
    if requested not in FORMATS:
        raise ValueError(f"--input-format must be one of {', '.join(FORMATS)}, got {requested!r}")
    if requested == "openai":
        return OpenAIBatchFormat()
    if requested == "simple" or source.text:
        return SimpleFormat(text=source.text)
    first = next(source.rows(), None)
    if first is not None:
        try:
            value = row_json(first)  # bounded (reading.py): a hostile first row is an error row, not a crash
        except RowProblem:
            value = head_custom_id(first) and {"custom_id": None}  # an over-long batch row still names its id
        if isinstance(value, dict) and {"custom_id", "url", "body"} & set(value):
            return OpenAIBatchFormat()
    return SimpleFormat()
