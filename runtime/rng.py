"""Per-request randomness: every random draw of a sampled row derives from (job seed, the row's key) alone.

A row's stream seed is ``row_seed(seed, key)`` (the key: the row's index in its input, or its custom_id). Each
draw is then addressed by where it happens in the row's own history, never by the batch, pass or wave it shares:

    draw_seed(row, committed, stream, token)

  committed  the row's committed tokens (prompt + output) when its draft round began: every verify of the row
             commits at least one token, so this names the round uniquely;
  stream     DRAFT (the drafter's sample of draft token `token` of the round) or VERIFY (the verifier's
             uniforms and its recovered / bonus sample);
  token      the draft token's index in the round (0 for VERIFY).

A draw is a fresh `torch.Generator` seeded with that value (counter-based, like Philox streams keyed by
(request, step)), so a row's samples are identical whatever the batch size, the rows beside it, the chunking,
the backend or the resume point, at the same drafter and k. Unseeded requests get a random row seed once, at
admission.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

import torch

DRAFT = 1
VERIFY = 0
_MASK = (1 << 63) - 1


def _hash(*parts: object) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def row_seed(seed: int | None, key: int | str) -> int:
    """The stream seed of the row keyed `key` in a job seeded `seed` (None: a random one, drawn now)."""
    if seed is None:
        return secrets.randbits(63)
    return _hash("row", int(seed), key)


def draw_seed(row: int, committed: int, stream: int, token: int = 0) -> int:
    """The seed of one draw of a row (see the module docstring)."""
    return _hash(row, committed, stream, token)


def generators(seeds: Sequence[int]) -> list[torch.Generator]:
    """One CPU generator per seed."""
    return [torch.Generator().manual_seed(int(s)) for s in seeds]
