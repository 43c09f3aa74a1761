"""KVCache: literal unit tests plus a hypothesis state machine checked against a plain-Python model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from specoffload.runtime.kv_cache import CacheCapacityError, KVCache

LAYERS, BATCH, KV_HEADS, DIM = 2, 3, 2, 4


def stamped(values: list[list[float]], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [BATCH, KV_HEADS, T, DIM] whose every (row, t) slice is filled with values[row][t] (+ layer)."""
    k = torch.tensor(values, dtype=torch.float32) + 1000 * layer  # [B, T]
    k = k[:, None, :, None].expand(BATCH, KV_HEADS, len(values[0]), DIM).clone()
    return k, -k


def write_all_layers(cache: KVCache, values: list[list[float]]) -> None:
    for layer in range(LAYERS):
        cache.write(layer, *stamped(values, layer))


def read_back(cache: KVCache, layer: int, row: int) -> list[float]:
    """The valid keys of one row as stamps; checks values mirror keys and all heads/dims agree."""
    n = int(cache.lengths[row])
    k, v = cache.keys_values(layer, n)  # [B, KV_HEADS, n, DIM]
    k, v = k[row], v[row]  # [KV_HEADS, n, DIM]
    assert torch.equal(v, -k)
    assert torch.equal(k, k[:1, :, :1].expand_as(k))
    return [x - 1000 * layer for x in k[0, :, 0].tolist()]


def new_cache(capacity: int = 8, growable: bool = True) -> KVCache:
    return KVCache(LAYERS, BATCH, KV_HEADS, DIM, capacity, torch.float32, "cpu", growable)


def test_write_is_invisible_until_advance_and_lands_at_each_rows_length() -> None:
    cache = new_cache()
    write_all_layers(cache, [[1, 2], [3, 4], [5, 6]])
    assert cache.lengths.tolist() == [0, 0, 0]
    cache.advance(torch.tensor([2, 1, 0]))
    assert [read_back(cache, 1, b) for b in range(3)] == [[1, 2], [3], []]
    write_all_layers(cache, [[7], [8], [9]])
    cache.advance(1)
    assert [read_back(cache, 0, b) for b in range(3)] == [[1, 2, 7], [3, 8], [9]]


def test_truncate_reset_and_errors() -> None:
    cache = new_cache()
    write_all_layers(cache, [[1, 2, 3]] * 3)
    cache.advance(3)
    cache.truncate(torch.tensor([1, 3, 0]))
    assert cache.lengths.tolist() == [1, 3, 0]
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(torch.tensor([2, 3, 0]))
    with pytest.raises(ValueError, match="negative"):
        cache.advance(torch.tensor([0, -1, 0]))
    cache.reset_rows([1])
    assert cache.lengths.tolist() == [1, 0, 0]


def test_growth_keeps_contents_and_fixed_capacity_raises() -> None:
    cache = new_cache(capacity=2)
    write_all_layers(cache, [[1, 2]] * 3)
    cache.advance(2)
    write_all_layers(cache, [[3, 4, 5]] * 3)
    cache.advance(3)
    assert cache.capacity >= 5 and cache.capacity % 16 == 0
    assert read_back(cache, 1, 2) == [1, 2, 3, 4, 5]

    fixed = new_cache(capacity=2, growable=False)
    with pytest.raises(CacheCapacityError, match="holds 2"):
        write_all_layers(fixed, [[1, 2, 3]] * 3)
    with pytest.raises(CacheCapacityError):
        fixed.advance(3)


def test_nbytes_and_used_bytes() -> None:
    cache = KVCache(LAYERS, BATCH, KV_HEADS, DIM, 8, torch.bfloat16)
    assert cache.nbytes() == 2 * LAYERS * BATCH * KV_HEADS * 8 * DIM * 2
    write_all_layers(cache, [[1, 2]] * 3)
    cache.advance(torch.tensor([2, 1, 0]))
    assert cache.used_bytes() == 2 * LAYERS * KV_HEADS * DIM * 2 * 3


def test_select_rows_and_assign_rows() -> None:
    cache = new_cache()
    write_all_layers(cache, [[1, 2], [3, 4], [5, 6]])
    cache.advance(torch.tensor([2, 1, 0]))
    cache.select_rows([2, 0])
    assert cache.batch_size == 2 and cache.lengths.tolist() == [0, 2]
    assert cache.k.shape[1] == 2

    target = new_cache(capacity=2)
    source = new_cache(capacity=5)
    write_all_layers(target, [[1, 2], [3, 4], [5, 6]])
    target.advance(torch.tensor([2, 2, 2]))
    write_all_layers(source, [[7, 8, 9], [10, 11, 12], [13, 14, 15]])
    source.advance(torch.tensor([3, 1, 0]))
    source.select_rows([0, 1])
    target.assign_rows([2, 0], source)  # source row 0 -> target row 2, source row 1 -> target row 0
    assert target.lengths.tolist() == [1, 2, 3] and target.capacity >= 3
    assert [read_back(target, 1, b) for b in range(3)] == [[10], [3, 4], [7, 8, 9]]


class CacheMachine(RuleBasedStateMachine):
    """Random write / advance / truncate / reset sequences against a list-of-stamps model.

    Model per row: `valid` (what positions 0..len-1 must read back) and `pending` (written past the length,
    may be validated by advance). A fresh stamp per written token makes stale reads detectable.
    """

    @initialize(capacity=st.integers(1, 6), growable=st.booleans())
    def setup(self, capacity: int, growable: bool) -> None:
        self.cache = new_cache(capacity, growable)
        self.valid: list[list[float]] = [[] for _ in range(BATCH)]
        self.pending: list[list[float]] = [[] for _ in range(BATCH)]
        self.next_stamp = 1.0

    @rule(steps=st.integers(1, 4))
    def write(self, steps: int) -> None:
        values = [[self.next_stamp + b * 10 + t for t in range(steps)] for b in range(BATCH)]
        self.next_stamp += 100
        needed = max(len(v) for v in self.valid) + steps
        if needed > self.cache.capacity and not self.cache.growable:
            with pytest.raises(CacheCapacityError):
                write_all_layers(self.cache, values)
            return
        write_all_layers(self.cache, values)
        self.pending = values

    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        counts = [data.draw(st.integers(0, len(p))) for p in self.pending]
        self.cache.advance(torch.tensor(counts))
        for b, n in enumerate(counts):
            self.valid[b] += self.pending[b][:n]
            self.pending[b] = self.pending[b][n:]

    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        new_lengths = [data.draw(st.integers(0, len(v))) for v in self.valid]
        self.cache.truncate(torch.tensor(new_lengths))
        self.valid = [v[:n] for v, n in zip(self.valid, new_lengths, strict=True)]
        self.pending = [[] for _ in range(BATCH)]

    @precondition(lambda self: any(self.valid))
    @rule(data=st.data())
    def truncate_too_far_fails(self, data: st.DataObject) -> None:
        row = data.draw(st.sampled_from([b for b in range(BATCH) if self.valid[b]]))
        bad = [len(v) for v in self.valid]
        bad[row] += 1
        with pytest.raises(ValueError):
            self.cache.truncate(torch.tensor(bad))

    @rule(rows=st.sets(st.integers(0, BATCH - 1), min_size=1))
    def reset(self, rows: set[int]) -> None:
        self.cache.reset_rows(sorted(rows))
        for b in rows:
            self.valid[b], self.pending[b] = [], []

    @invariant()
    def matches_model(self) -> None:
        cache = self.cache
        assert cache.lengths.tolist() == [len(v) for v in self.valid]
        for layer in range(LAYERS):
            assert [read_back(cache, layer, b) for b in range(BATCH)] == self.valid
        assert cache.nbytes() == 2 * LAYERS * BATCH * KV_HEADS * cache.capacity * DIM * 4
        assert cache.used_bytes() == 2 * LAYERS * KV_HEADS * DIM * 4 * sum(map(len, self.valid))


CacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
test_cache_machine = CacheMachine.TestCase


def test_add_rows_appends_empty_rows_and_keeps_the_others() -> None:
    cache = new_cache(capacity=4)
    write_all_layers(cache, [[1.0, 2.0]] + [[3.0, 4.0]] * (BATCH - 1))
    cache.advance(2)
    cache.add_rows(2)
    assert cache.batch_size == BATCH + 2 and cache.lengths.tolist() == [2] * BATCH + [0, 0]
    assert cache.k.shape[1] == BATCH + 2 and cache.capacity == 4
    assert read_back(cache, 1, 0) == [1.0, 2.0] and read_back(cache, 0, BATCH + 1) == []
    with pytest.raises(ValueError):
        cache.add_rows(-1)
