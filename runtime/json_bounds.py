"""JSON from untrusted bytes with its nesting depth and number lengths bounded *before* it is parsed.

Python's `json.loads` recurses once per nesting level (200,000 brackets end in RecursionError) and converts a long
run of digits with an O(n^2) algorithm until `sys.int_max_str_digits` stops it with its own ValueError. So the raw
bytes are scanned first, without recursion and in bounded memory:

  1. the strings are blanked out (one linear regex over the bytes: a JSON string is a quote, then characters that
     are not a quote or a backslash or are a backslash escape, then a quote);
  2. outside them, no run of digits may be longer than `max_digits` (integers, fractions and exponents alike);
  3. outside them, at most `max_items` values (commas + 1: a list of a million ids is ~40 MB of Python objects);
  4. and the brackets `[`/`{` minus `]`/`}` may never add up past `max_depth` (a cumulative sum in blocks).

Only then is `json.loads` called. Text that is not JSON at all passes the scan unchanged or fails it; either way
`json.loads` then reports it. `BoundsError` (a ValueError) says which limit, with the numbers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

#: a JSON string (the "unrolled loop" form: linear, no backtracking)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
#: bytes that are not brackets, deleted before the depth count
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DELTA = np.zeros(256, dtype=np.int8)
_DELTA[list(b"[{")] = 1
_DELTA[list(b"]}")] = -1
_BLOCK = 1 << 16  # brackets counted per numpy block (bounded memory for any input)


class BoundsError(ValueError):
    """JSON nested deeper, or with a longer number, than the limits allow."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # "too_deep", "number_too_long" or "too_many_items"


@dataclass(frozen=True)
class JsonBounds:
    max_depth: int = 32
    max_digits: int = 64
    max_items: int = 1 << 20


def check_bounds(data: bytes, bounds: JsonBounds) -> None:
    """Raise BoundsError if `data` nests deeper than bounds.max_depth or has a digit run over bounds.max_digits."""
    outside = _STRING.sub(b'""', data) if b'"' in data else data
    long_number = re.search(rb"[0-9]{%d}" % (bounds.max_digits + 1), outside)
    if long_number is not None:
        raise BoundsError("number_too_long", f"a number with more than {bounds.max_digits} digits (at byte "
                                             f"{long_number.start()} outside strings)")
    items = outside.count(b",") + 1
    if items > bounds.max_items:
        raise BoundsError("too_many_items", f"{items} values, over the limit of {bounds.max_items}")
    brackets = outside.translate(None, _NOT_BRACKETS)
    if brackets.count(b"[") + brackets.count(b"{") <= bounds.max_depth:
        return  # fewer opening brackets than the limit: no deeper nesting possible
    depth = 0
    for start in range(0, len(brackets), _BLOCK):
        running = depth + np.cumsum(_DELTA[np.frombuffer(brackets, np.uint8, min(_BLOCK, len(brackets) - start),
                                                         start)], dtype=np.int64)
        if int(running.max()) > bounds.max_depth:
            raise BoundsError("too_deep", f"nested more than {bounds.max_depth} levels deep")
        depth = int(running[-1])


def loads_bounded(data: bytes | str, bounds: JsonBounds = JsonBounds()) -> Any:
    """`json.loads` after `check_bounds`. Raises BoundsError, json.JSONDecodeError or UnicodeDecodeError (all
    ValueError), never RecursionError."""
    if isinstance(data, str):
        text, raw = data, data.encode("utf-8", "surrogatepass")
    else:  # strict UTF-8 (json.loads would guess UTF-16/32 from bytes, which the scan does not read)
        text, raw = data.decode("utf-8"), data
    check_bounds(raw, bounds)
    return json.loads(text)
