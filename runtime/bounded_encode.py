"""Tokenize a prompt only as far as needed to know it fits: a text far longer than the context is refused after
encoding a bounded prefix, in pieces, never the whole (a fast tokenizer needs ~100-200 bytes of memory per
character it encodes at once: a 10 MB line took 2.7 GB).

A text of at most `PIECE_CHARS` characters is encoded whole. A longer one is encoded piece by piece (pieces of
`PIECE_CHARS` characters, each cut after the last whitespace of its final quarter when there is one, so a cut
rarely splits a word) while the tokens counted so far, less `BOUNDARY_SLACK` per cut, stay under the limit; once
they reach it the text is refused with that count as a lower bound (a cut can change how the few tokens around it
merge, which the slack covers; tests/test_input_bounds.py measures it on real text). A text whose pieces stay
under the limit is then encoded whole, for the exact ids: it has fewer tokens than the limit, so its length is at
most the limit times the longest token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

PIECE_CHARS = 1 << 16
BOUNDARY_SLACK = 8
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class TooLong:
    """A text refused from a prefix: it has at least `at_least` tokens (>= the limit)."""

    at_least: int


def encode_bounded(tokenizer: Any, text: str, limit: int) -> list[int] | TooLong:
    """`tokenizer.encode(text)` (no special tokens added), or TooLong when the text surely has >= `limit` tokens.
    Raises ValueError for text that is not Unicode (an unpaired surrogate, which JSON's \\ud800 can carry and a fast
    tokenizer refuses with a TypeError)."""
    bad = _SURROGATE.search(text)
    if bad is not None:
        raise ValueError(f"the text has an unpaired surrogate (U+{ord(bad.group()):04X}) at character {bad.start()}: "
                         "not Unicode text")
    if len(text) > PIECE_CHARS:
        counted = 0
        for cuts, piece in enumerate(_pieces(text)):
            counted += len(tokenizer.encode(piece, add_special_tokens=False))
            if counted - BOUNDARY_SLACK * cuts >= limit:
                return TooLong(counted - BOUNDARY_SLACK * cuts)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _pieces(text: str) -> Any:
    start = 0
    while start < len(text):
        end = min(start + PIECE_CHARS, len(text))
        if end < len(text):
            cut = max(text.rfind(" ", end - PIECE_CHARS // 4, end), text.rfind("\n", end - PIECE_CHARS // 4, end))
            end = cut + 1 if cut > start else end
        yield text[start:end]
        start = end
