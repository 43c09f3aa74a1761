"""Rows of target KV a memory budget holds: reserved at max_seq_len per row, or paged by expected use.

Contiguous caches reserve every row's full length at admission:

    positions_contiguous = max_seq_len + k_max + 1

(prompt + output, plus the k_max + 1 positions a verify pass writes past the committed ones: `Plan.kv_capacity`).
A paged cache (runtime/kv_blocks.py) holds whole blocks of the positions a row uses, so a row costs on average

    positions_paged = block_size * ceil((ceil(prompt_len + expected_new_tokens) + k_max + 1) / block_size)

where the expected output is the workload's new tokens unless a shorter mean is known (rows that stop at an end
token). rows = floor(budget / (kv_bytes_per_token * positions)) each way; `KVRows.gain` is their ratio, the
`kv_rows_gain` a benchmark reports. Expected use is a mean: a pool sized by it needs a runtime that preempts a
row when a write finds no free block (`OutOfBlocksError`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .cost import Workload


@dataclass(frozen=True)
class KVRows:
    """Rows of target KV one budget holds, paged by expected use and reserved at max_seq_len."""

    by_blocks: int
    by_max_seq_len: int
    positions_by_blocks: int  # KV positions per row, paged (whole blocks)
    positions_by_max_seq_len: int  # KV positions per row, contiguous

    @property
    def gain(self) -> float:
        """by_blocks / by_max_seq_len (`kv_rows_gain`); inf when max_seq_len fits no row and blocks fit some."""
        if self.by_max_seq_len == 0:
            return math.inf if self.by_blocks else 1.0
        return self.by_blocks / self.by_max_seq_len


def expected_kv_tokens(workload: Workload, k_max: int, expected_new_tokens: float | None = None) -> int:
    """KV positions a row is expected to use: ceil(prompt_len + expected output) + k_max + 1 (module docstring)."""
    new = workload.new_tokens if expected_new_tokens is None else expected_new_tokens
    if not 0 <= new <= workload.new_tokens or k_max < 0:
        raise ValueError(f"expected_new_tokens must lie in [0, {workload.new_tokens}] and k_max >= 0, "
                         f"got {new}, {k_max}")
    return math.ceil(workload.prompt_len + new) + k_max + 1


def kv_rows(budget_bytes: int, kv_bytes_per_token: int, workload: Workload, max_seq_len: int, k_max: int,
            block_size: int, expected_new_tokens: float | None = None) -> KVRows:
    """The rows of target KV `budget_bytes` holds paged by expected use versus reserved at max_seq_len (module
    docstring). kv_bytes_per_token: K + V bytes of one position over all layers (`ModelShape.kv_bytes_per_token`)."""
    if block_size < 1 or kv_bytes_per_token < 1 or max_seq_len < 1 or budget_bytes < 0:
        raise ValueError("kv_rows needs block_size, kv_bytes_per_token, max_seq_len >= 1 and budget_bytes >= 0")
    contiguous = max_seq_len + k_max + 1
    expected = min(expected_kv_tokens(workload, k_max, expected_new_tokens), contiguous)
    paged = math.ceil(expected / block_size) * block_size
    return KVRows(by_blocks=budget_bytes // (kv_bytes_per_token * paged),
                  by_max_seq_len=budget_bytes // (kv_bytes_per_token * contiguous),
                  positions_by_blocks=paged, positions_by_max_seq_len=contiguous)
