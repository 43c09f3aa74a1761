"""Every custom_id of an OpenAI batch input once: checked before the job starts (the Batch API requires them unique,
and a resumed output is matched to its input by them). A repeat stops the job with one line naming the line of the
first repeat and the line it repeats.

Memory stays flat for millions of rows: one pass keeps an 8-byte hash per row (numpy), sorted to find equal hashes;
only if some collide does a second pass compare those rows' actual ids (a hash collision is no repeat).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterable

import numpy as np

from .rows import RowError, RowRequest
from .source import RawRow


class DuplicateIdError(ValueError):
    """Two rows of one input with the same custom_id."""


def _key(custom_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def check_unique_ids(rows: Callable[[], Iterable[RawRow]], parse: Callable[[RawRow], RowRequest | RowError],
                     where: Callable[[int], str]) -> None:
    """Raise DuplicateIdError naming the first row (in input order) whose custom_id an earlier row has. `rows`
    gives a fresh pass over the input each call; rows without a custom_id (error rows) are not compared."""
    keys = array("Q")
    for raw in rows():
        custom_id = parse(raw).custom_id
        if custom_id is not None:
            keys.append(_key(custom_id))
    if len(keys) < 2:
        return
    ordered = np.sort(np.frombuffer(keys, dtype=np.uint64))
    colliding = set(ordered[1:][ordered[1:] == ordered[:-1]].tolist())
    if not colliding:
        return
    first_line: dict[str, int] = {}  # only the rows whose hash collides
    for raw in rows():
        custom_id = parse(raw).custom_id
        if custom_id is None or _key(custom_id) not in colliding:
            continue
        if custom_id in first_line:
            raise DuplicateIdError(f"{where(raw.lineno)}: custom_id {custom_id!r:.80} repeats line "
                                   f"{first_line[custom_id]}'s; the Batch API needs each custom_id unique (the "
                                   "job did not start)")
        first_line[custom_id] = raw.lineno
