"""A raw row's bytes -> its JSON value, bounded: the line's length (source.py), then its nesting depth and number
lengths (runtime/json_bounds.py) are checked before `json.loads` runs, so a hostile line becomes one error row.

Limits (README, "Offline corpora"): a line of at most `source.MAX_LINE_BYTES` bytes, JSON nested at most
`ROW_BOUNDS.max_depth` levels, numbers of at most `ROW_BOUNDS.max_digits` digits, at most `ROW_BOUNDS.max_items`
values (commas + 1 outside strings).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..json_bounds import BoundsError, JsonBounds, loads_bounded
from .source import RawRow

ROW_BOUNDS = JsonBounds(max_depth=32, max_digits=64, max_items=1 << 20)
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_CUSTOM_ID = re.compile(rb'"custom_id"\s*:\s*"((?:[^"\\]|\\.){0,256})"')


class RowProblem(ValueError):
    """Why a row's bytes are not a JSON value this engine will read; `code` is the error row's code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def too_long(raw: RawRow) -> RowProblem | None:
    if raw.too_long is None:
        return None
    length, limit = raw.too_long
    return RowProblem("line_too_long", f"the line has {length} bytes, over the limit of {limit} bytes per line")


def row_text(raw: RawRow) -> str:
    """The row as text (strict UTF-8). Raises RowProblem."""
    problem = too_long(raw)
    if problem is not None:
        raise problem
    try:
        return raw.data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RowProblem("invalid_utf8", f"not UTF-8 ({err.reason} at byte {err.start})") from None


def row_json(raw: RawRow) -> Any:
    """The row's JSON value, parsed only once its bounds are checked. Raises RowProblem."""
    text = row_text(raw)
    try:
        value = loads_bounded(text, ROW_BOUNDS)
    except BoundsError as err:
        raise RowProblem(err.code, f"JSON {err}") from None
    except json.JSONDecodeError as err:
        raise RowProblem("invalid_json", f"invalid JSON ({err.msg})") from None
    if _ESCAPED_SURROGATE.search(text) and _has_surrogate(value):  # only a \uD800-style escape can make one
        raise RowProblem("invalid_json", "a string with an unpaired surrogate escape (\\uD800-\\uDFFF alone): "
                                         "not Unicode text")
    return value


def _has_surrogate(value: Any) -> bool:
    """Any string (key or value) with an unpaired surrogate; recursion is bounded by ROW_BOUNDS.max_depth."""
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if isinstance(value, list):
        return any(_has_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    return False


def head_custom_id(raw: RawRow) -> str | None:
    """An over-long or unparsable row's custom_id, if its first bytes name one plainly (for its error row)."""
    match = _CUSTOM_ID.search(raw.data[:4096])
    if match is None:
        return None
    try:
        value = json.loads(b'"' + match.group(1) + b'"')
    except ValueError:
        return None
    return value if isinstance(value, str) and not _SURROGATE.search(value) else None
