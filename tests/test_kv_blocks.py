"""BlockPool and PagedKVCache: literal cases, a hypothesis state machine against the contiguous KVCache, and the
Transformer's logits over both caches on tiny random checkpoints."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from specoffload.runtime.kv_blocks import BlockPool, OutOfBlocksError, PagedKVCache
from specoffload.runtime.kv_cache import CacheCapacityError, KVCache
from specoffload.runtime.models.model import Transformer

LAYERS, KV_HEADS, DIM = 2, 2, 3


def pool(blocks: int = 16, block_size: int = 2) -> BlockPool:
    return BlockPool(LAYERS, blocks, block_size, KV_HEADS, DIM)


def stamped(values: list[list[float]], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [rows, KV_HEADS, T, DIM] whose every (row, t) slice is filled with values[row][t] (+ 1000 * layer)."""
    k = torch.tensor(values, dtype=torch.float32) + 1000 * layer  # [rows, T]
    k = k[:, None, :, None].expand(len(values), KV_HEADS, len(values[0]), DIM).clone()
    return k, -k


def write_all_layers(cache: KVCache | PagedKVCache, values: list[list[float]]) -> None:
    for layer in range(LAYERS):
        cache.write(layer, *stamped(values, layer))


def read_back(cache: KVCache | PagedKVCache, layer: int, row: int) -> list[float]:
    """The valid keys of one row as stamps; checks values mirror keys and all heads/dims agree."""
    n = int(cache.lengths.max()) if cache.batch_size else 0
    k, v = cache.keys_values(layer, n)  # [rows, KV_HEADS, n, DIM]
    k, v = k[row, :, : int(cache.lengths[row])], v[row, :, : int(cache.lengths[row])]
    assert torch.equal(v, -k)
    assert torch.equal(k, k[:1, :, :1].expand_as(k))
    return [x - 1000 * layer for x in k[0, :, 0].tolist()]


def state(cache: PagedKVCache) -> tuple:
    """Everything a failed operation must leave unchanged: lengths, blocks per row, free blocks, valid contents."""
    rows = [[read_back(cache, layer, b) for b in range(cache.batch_size)] for layer in range(LAYERS)]
    return cache.lengths.tolist(), cache.blocks_held(), cache.pool.free_blocks, cache.capacity, rows


# ---- BlockPool ---------------------------------------------------------------------------------------------------


def test_pool_allocates_frees_and_refuses_a_double_free() -> None:
    p = pool(blocks=4, block_size=3)
    assert p.k.shape == (LAYERS, 4 + 1, KV_HEADS, 3, DIM) and p.v.shape == p.k.shape  # (+1: the sink block)
    assert p.sink == 4
    assert [p.blocks_for(n) for n in (0, 1, 3, 4, 7)] == [0, 1, 1, 2, 3]
    assert p.block_nbytes == 2 * LAYERS * 3 * KV_HEADS * DIM * 4 and p.nbytes() == 5 * p.block_nbytes
    first = p.allocate(3)
    assert first == [0, 1, 2] and p.free_blocks == 1 and p.used_blocks == 3
    with pytest.raises(OutOfBlocksError, match="2 KV blocks needed, 1 free") as info:
        p.allocate(2)
    assert (info.value.needed, info.value.free) == (2, 1) and p.free_blocks == 1
    assert isinstance(info.value, CacheCapacityError)
    p.free([1])
    with pytest.raises(ValueError, match="not in use"):
        p.free([1])
    with pytest.raises(ValueError, match="not in use"):
        p.free([0, 0])
    assert p.free_blocks == 2 and p.allocate(2) == [1, 3]


def test_fresh_blocks_are_zeroed_when_first_handed_out() -> None:
    p = pool(blocks=4, block_size=2)
    assert p.touched == 1 and not p.k[:, 0].any() and not p.v[:, 0].any()  # block 0 pads block tables
    p.k[:, 1:] = p.v[:, 1:] = float("nan")  # what empty storage may hold
    cache = PagedKVCache(p, batch_size=1, capacity=8)
    write_all_layers(cache, [[1, 2, 3]])  # blocks 0 and 1; slot 1 of block 1 is not written
    cache.advance(3)
    assert p.touched == 2 and p.k[:, 2:].isnan().all()  # blocks 2 and 3 untouched
    k, v = cache.keys_values(0, 4)
    assert k[0, 0, :, 0].tolist() == [1, 2, 3, 0] and v[0, 0, :, 0].tolist() == [-1, -2, -3, 0]
    cache.truncate(torch.tensor([1]))  # block 1 back, with its keys: reused without zeroing
    assert p.allocate(1) == [1] and p.touched == 2 and p.k[0, 1, 0, 0, 0] == 3  # position 2 of the row


def test_pool_for_bytes_counts_whole_blocks() -> None:
    per_block = 2 * LAYERS * 4 * KV_HEADS * DIM * 4  # 384 bytes
    assert BlockPool.for_bytes(10 * per_block + 100, 4, LAYERS, KV_HEADS, DIM).num_blocks == 10
    assert BlockPool.for_bytes(10, 4, LAYERS, KV_HEADS, DIM).num_blocks == 1
    with pytest.raises(ValueError):
        BlockPool(LAYERS, 0, 4, KV_HEADS, DIM)


# ---- PagedKVCache: literal cases ---------------------------------------------------------------------------------


def test_write_allocates_blocks_and_advance_frees_the_padded_ones() -> None:
    cache = PagedKVCache(pool(block_size=2), batch_size=3, capacity=16)
    write_all_layers(cache, [[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    assert cache.lengths.tolist() == [0, 0, 0] and cache.blocks_held() == [2, 2, 2]
    cache.advance(torch.tensor([3, 1, 0]))
    assert cache.blocks_held() == [2, 1, 0] and cache.pool.used_blocks == 3
    assert [read_back(cache, 1, b) for b in range(3)] == [[1, 2, 3], [4], []]
    write_all_layers(cache, [[10], [11], [12]])
    cache.advance(1)
    assert cache.blocks_held() == [2, 1, 1]
    assert [read_back(cache, 0, b) for b in range(3)] == [[1, 2, 3, 10], [4, 11], [12]]
    k, v = cache.keys_values(0, 4)
    assert k.shape == v.shape == (3, KV_HEADS, 4, DIM)
    with pytest.raises(ValueError, match="not written"):
        cache.advance(torch.tensor([0, 1, 0]))  # row 1 holds one block of 2 positions, 2 of them valid already


def test_keys_values_reuses_its_buffers() -> None:
    cache = PagedKVCache(pool(block_size=2), batch_size=2, capacity=16)
    write_all_layers(cache, [[1, 2, 3], [4, 5, 6]])
    cache.advance(3)
    k0, _ = cache.keys_values(0, 3)
    pointer = k0.data_ptr()
    k1, v1 = cache.keys_values(1, 2)  # a shorter read: the same buffers, layer 1 now
    assert k1.data_ptr() == pointer and k1[1, 0, :, 0].tolist() == [1004, 1005] and torch.equal(v1, -k1)
    write_all_layers(cache, [[7] * 5, [8] * 5])
    cache.advance(5)
    k2, _ = cache.keys_values(0, 8)  # longer: the buffers grow
    assert k2.shape == (2, KV_HEADS, 8, DIM) and k2[0, 0, :, 0].tolist() == [1, 2, 3, 7, 7, 7, 7, 7]


def test_truncate_reset_and_select_rows_free_blocks_without_moving_data() -> None:
    cache = PagedKVCache(pool(block_size=2), batch_size=3, capacity=16)
    write_all_layers(cache, [[1, 2, 3, 4, 5]] * 3)
    cache.advance(5)
    assert cache.pool.used_blocks == 9
    cache.truncate(torch.tensor([4, 5, 1]))
    assert cache.blocks_held() == [2, 3, 1] and cache.pool.used_blocks == 6
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(torch.tensor([5, 5, 1]))
    cache.reset_rows([0])
    assert cache.lengths.tolist() == [0, 5, 1] and cache.blocks_held() == [0, 3, 1]
    storage = cache.pool.k.data_ptr()
    row1 = list(cache._blocks[1])
    cache.select_rows([1])
    assert cache.batch_size == 1 and cache.lengths.tolist() == [5] and cache.pool.used_blocks == 3
    assert cache._blocks[0] == row1 and cache.pool.k.data_ptr() == storage
    assert read_back(cache, 1, 0) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="repeat"):
        cache.select_rows([0, 0])


def test_out_of_blocks_leaves_the_cache_unchanged() -> None:
    cache = PagedKVCache(pool(blocks=5, block_size=2), batch_size=2, capacity=16)
    write_all_layers(cache, [[1, 2, 3], [4, 5, 6]])
    cache.advance(torch.tensor([3, 2]))  # 2 + 1 blocks
    before = state(cache)
    with pytest.raises(OutOfBlocksError):
        write_all_layers(cache, [[7, 8, 9], [10, 11, 12]])  # needs 3 + 3 blocks: 3 more, 2 free
    assert state(cache) == before
    source = KVCache(LAYERS, 2, KV_HEADS, DIM, 8)
    write_all_layers(source, [[1] * 7, [2] * 7])
    source.advance(7)
    with pytest.raises(OutOfBlocksError):
        cache.assign_rows([0, 1], source)  # 4 + 4 blocks, 2 free + 3 released
    assert state(cache) == before
    cache.truncate(torch.tensor([1, 2]))  # frees one block: the write fits now
    write_all_layers(cache, [[7, 8, 9], [10, 11, 12]])
    cache.advance(torch.tensor([3, 1]))
    assert [read_back(cache, 0, b) for b in range(2)] == [[1, 7, 8, 9], [4, 5, 10]]


def test_assign_rows_from_contiguous_and_paged_sources() -> None:
    shared = pool(blocks=20, block_size=2)
    target = PagedKVCache(shared, batch_size=3, capacity=2)
    write_all_layers(target, [[1, 2], [3, 4], [5, 6]])
    target.advance(2)
    source = KVCache(LAYERS, 2, KV_HEADS, DIM, 5)
    write_all_layers(source, [[7, 8, 9], [10, 11, 12]])
    source.advance(torch.tensor([3, 1]))
    target.assign_rows([2, 0], source)  # source row 0 -> target row 2, source row 1 -> target row 0
    assert target.lengths.tolist() == [1, 2, 3] and target.capacity >= 3
    assert [read_back(target, 1, b) for b in range(3)] == [[10], [3, 4], [7, 8, 9]]
    assert target.blocks_held() == [1, 1, 2] and shared.used_blocks == 4

    paged = PagedKVCache(shared, batch_size=1, capacity=8)
    write_all_layers(paged, [[20, 21, 22, 23, 24]])
    paged.advance(5)
    target.assign_rows([1], paged)
    assert read_back(target, 0, 1) == [20, 21, 22, 23, 24] and target.blocks_held() == [1, 3, 2]
    paged.release()
    assert shared.used_blocks == 6


def test_add_rows_appends_empty_rows() -> None:
    cache = PagedKVCache(pool(block_size=2), batch_size=1, capacity=16)
    write_all_layers(cache, [[1, 2, 3]])
    cache.advance(3)
    cache.add_rows(2)
    assert cache.batch_size == 3 and cache.lengths.tolist() == [3, 0, 0] and cache.blocks_held() == [2, 0, 0]
    write_all_layers(cache, [[4], [5], [6]])
    cache.advance(torch.tensor([1, 1, 0]))
    assert [read_back(cache, 0, b) for b in range(3)] == [[1, 2, 3, 4], [5], []]


def test_two_caches_share_one_pool() -> None:
    shared = pool(blocks=6, block_size=2)
    a, b = PagedKVCache(shared, 2, 16), PagedKVCache(shared, 1, 16)
    write_all_layers(a, [[1, 2, 3], [4, 5, 6]])
    a.advance(3)
    write_all_layers(b, [[7, 8]])
    b.advance(2)
    assert shared.free_blocks == 1 and a.nbytes() == 4 * shared.block_nbytes
    with pytest.raises(OutOfBlocksError):
        write_all_layers(b, [[9, 10, 11]])
    a.release()
    write_all_layers(b, [[9, 10, 11]])
    b.advance(3)
    assert read_back(b, 1, 0) == [7, 8, 9, 10, 11] and shared.used_blocks == 3 and a.lengths.tolist() == [0, 0]


def test_capacity_is_a_limit_not_a_reservation() -> None:
    cache = PagedKVCache(pool(block_size=2), batch_size=2, capacity=2)
    assert cache.nbytes() == 0 and cache.pool.used_blocks == 0
    write_all_layers(cache, [[1, 2, 3]] * 2)  # growable: the limit rises
    cache.advance(torch.tensor([3, 2]))
    assert cache.capacity == 3 and cache.nbytes() == 3 * cache.pool.block_nbytes
    assert cache.used_bytes() == 2 * LAYERS * KV_HEADS * DIM * 4 * 5
    fixed = PagedKVCache(pool(block_size=2), batch_size=1, capacity=2, growable=False)
    with pytest.raises(CacheCapacityError, match="holds 2"):
        write_all_layers(fixed, [[1, 2, 3]])
    assert fixed.pool.used_blocks == 0


def test_scratch_view_writes_into_the_owners_blocks_and_frees_nothing() -> None:
    owner = PagedKVCache(pool(block_size=2), batch_size=2, capacity=16)
    write_all_layers(owner, [[1, 2, 3], [4, 5, 6]])
    owner.advance(torch.tensor([3, 1]))
    view = owner.scratch_view()
    write_all_layers(view, [[7, 8], [9, 10]])  # positions 3..4 and 1..2: new blocks, in the owner's tables
    view.advance(2)
    assert owner.lengths.tolist() == [3, 1] and view.lengths.tolist() == [5, 3]
    assert owner.blocks_held() == [3, 2] and view.blocks_held() == [3, 2]
    assert [read_back(view, 0, b) for b in range(2)] == [[1, 2, 3, 7, 8], [4, 9, 10]]
    view.truncate(torch.tensor([3, 1]))
    view.release()
    assert owner.blocks_held() == [3, 2]  # the view frees nothing
    write_all_layers(owner, [[11], [12]])  # the owner's own write over the drafted positions
    owner.advance(torch.tensor([1, 0]))  # and its advance frees what it does not keep
    assert owner.blocks_held() == [2, 1] and owner.pool.used_blocks == 3
    assert [read_back(owner, 1, b) for b in range(2)] == [[1, 2, 3, 11], [4]]
    with pytest.raises(RuntimeError, match="scratch view"):
        owner.scratch_view().add_rows(1)


def test_a_scratch_view_out_of_blocks_changes_nothing() -> None:
    owner = PagedKVCache(pool(blocks=3, block_size=2), batch_size=2, capacity=16)
    write_all_layers(owner, [[1, 2], [3, 4]])
    owner.advance(2)
    view = owner.scratch_view()
    before = state(owner)
    with pytest.raises(OutOfBlocksError):
        write_all_layers(view, [[5, 6, 7], [8, 9, 10]])  # 2 + 2 more blocks, 1 free
    assert state(owner) == before and view.lengths.tolist() == [2, 2]


def test_a_bfloat16_pool_stores_in_bfloat16() -> None:
    cache = PagedKVCache(BlockPool(LAYERS, 4, 2, KV_HEADS, DIM, torch.bfloat16), batch_size=1, capacity=8)
    write_all_layers(cache, [[1, 2, 3]])  # float32 in, small integers: exact in bfloat16
    cache.advance(3)
    k, _ = cache.keys_values(0, 3)
    assert k.dtype == torch.bfloat16 and read_back(cache, 0, 0) == [1, 2, 3]  # layer 0: no 1000 offset
    assert cache.nbytes() == 2 * cache.pool.block_nbytes == 2 * 2 * LAYERS * 2 * KV_HEADS * DIM * 2


# ---- PagedKVCache against KVCache ----------------------------------------------------------------------------------


class PagedMachine(RuleBasedStateMachine):
    """Random operations on a PagedKVCache and a KVCache side by side: equal lengths, equal valid keys and values,
    and the pool's blocks in use equal sum_b ceil(lengths[b] / block_size) (no leak, no double free). A write the
    pool cannot hold must raise OutOfBlocksError and change nothing; the reference then skips it."""

    @initialize(rows=st.integers(1, 4), block_size=st.integers(1, 4), blocks=st.integers(4, 24))
    def setup(self, rows: int, block_size: int, blocks: int) -> None:
        self.pool = pool(blocks, block_size)
        self.paged = PagedKVCache(self.pool, rows, capacity=4)
        self.ref = KVCache(LAYERS, rows, KV_HEADS, DIM, 4)
        self.stamp = 1.0

    def _values(self, rows: int, steps: int) -> list[list[float]]:
        values = [[self.stamp + 10 * b + t for t in range(steps)] for b in range(rows)]
        self.stamp += 100
        return values

    @rule(steps=st.integers(1, 5), data=st.data())
    def write_and_advance(self, steps: int, data: st.DataObject) -> None:
        values = self._values(self.paged.batch_size, steps)
        counts = torch.tensor([data.draw(st.integers(0, steps)) for _ in range(self.paged.batch_size)])
        before = state(self.paged)
        try:
            write_all_layers(self.paged, values)
        except OutOfBlocksError:
            assert state(self.paged) == before
            return
        self.paged.advance(counts)
        write_all_layers(self.ref, values)
        self.ref.advance(counts)

    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        lengths = torch.tensor([data.draw(st.integers(0, n)) for n in self.ref.lengths.tolist()])
        self.paged.truncate(lengths)
        self.ref.truncate(lengths)

    @rule(data=st.data())
    def reset_rows(self, data: st.DataObject) -> None:
        rows = data.draw(st.lists(st.integers(0, self.ref.batch_size - 1), unique=True))
        self.paged.reset_rows(rows)
        self.ref.reset_rows(rows)

    @rule(data=st.data())
    def select_rows(self, data: st.DataObject) -> None:
        rows = data.draw(st.permutations(range(self.ref.batch_size)))
        rows = rows[: data.draw(st.integers(1, len(rows)))]
        self.paged.select_rows(rows)
        self.ref.select_rows(rows)

    @rule(n=st.integers(0, 2))
    def add_rows(self, n: int) -> None:
        self.paged.add_rows(n)
        grown = KVCache(LAYERS, self.ref.batch_size + n, KV_HEADS, DIM, self.ref.capacity)
        grown.assign_rows(list(range(self.ref.batch_size)), self.ref)  # the reference: a bigger cache, rows copied
        self.ref = grown

    @rule(data=st.data(), paged_source=st.booleans())
    def assign_rows(self, data: st.DataObject, paged_source: bool) -> None:
        rows = data.draw(st.lists(st.integers(0, self.ref.batch_size - 1), unique=True, min_size=1))
        steps = data.draw(st.integers(1, 6))
        lengths = torch.tensor([data.draw(st.integers(0, steps)) for _ in rows])
        values = self._values(len(rows), steps)
        source = KVCache(LAYERS, len(rows), KV_HEADS, DIM, steps)
        write_all_layers(source, values)
        source.advance(lengths)
        origin: KVCache | PagedKVCache = source
        if paged_source:
            spare = BlockPool(LAYERS, 64, self.pool.block_size, KV_HEADS, DIM)  # a second pool: this one may be full
            origin = PagedKVCache(spare, len(rows), steps)
            write_all_layers(origin, values)
            origin.advance(lengths)
        before = state(self.paged)
        try:
            self.paged.assign_rows(rows, origin)
        except OutOfBlocksError:
            assert state(self.paged) == before
            return
        self.ref.assign_rows(rows, source)

    @rule(steps=st.integers(1, 4), data=st.data())
    def draft_through_a_scratch_view(self, steps: int, data: st.DataObject) -> None:
        """A drafter's round: writes past the valid positions through a view (blocks allocated in this cache; or
        OutOfBlocksError, or CacheCapacityError past the capacity a view cannot grow, with nothing changed), then
        this cache's own truncate to its lengths frees them."""
        view = self.paged.scratch_view()
        values = self._values(self.paged.batch_size, steps)
        before = state(self.paged)
        try:
            write_all_layers(view, values)
        except CacheCapacityError:
            assert state(self.paged) == before
            return
        view.advance(torch.tensor([data.draw(st.integers(0, steps)) for _ in range(view.batch_size)]))
        drafted = [self.pool.blocks_for(n + steps) for n in self.paged.lengths.tolist()]
        assert self.paged.blocks_held() == [max(d, h) for d, h in zip(drafted, before[1])]
        self.paged.truncate(self.paged.lengths)

    @invariant()
    def same_lengths_and_contents(self) -> None:
        assert self.paged.lengths.tolist() == self.ref.lengths.tolist()
        assert self.paged.batch_size == self.ref.batch_size
        for layer in range(LAYERS):
            assert [read_back(self.paged, layer, b) for b in range(self.paged.batch_size)] == [
                read_back(self.ref, layer, b) for b in range(self.ref.batch_size)]

    @invariant()
    def blocks_match_lengths(self) -> None:
        expected = [self.pool.blocks_for(n) for n in self.paged.lengths.tolist()]
        assert self.paged.blocks_held() == expected
        assert self.pool.used_blocks == sum(expected) == self.pool.num_blocks - self.pool.free_blocks
        held = [b for table in self.paged._blocks for b in table]
        assert len(set(held)) == len(held)


TestPagedAgainstContiguous = PagedMachine.TestCase
TestPagedAgainstContiguous.settings = settings(max_examples=100, stateful_step_count=25, deadline=None)


# ---- the Transformer over both caches ----------------------------------------------------------------------------


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("name", ["llama", "qwen2_moe", "mixtral"])
def test_forward_over_a_paged_cache_matches_the_contiguous_one(tiny_models: dict[str, Path], name: str) -> None:
    """A ragged prefill, then ragged multi-token steps (speculative-verify shaped: T = 3, some rows taking fewer)
    and a truncate: logits equal (fp32, 1e-5) and the pool holds exactly the blocks the lengths need."""
    model = Transformer(tiny_models[name])
    cfg = model.config
    shared = BlockPool(cfg.num_layers, 64, 4, cfg.num_kv_heads, cfg.head_dim)
    paged = PagedKVCache(shared, 3, capacity=8)
    contiguous = model.new_cache(3, capacity=8)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([7, 3, 12])
    ids = torch.randint(3, 512, (3, 12), generator=gen)
    steps = [(ids, lengths), *[(torch.randint(3, 512, (3, 3), generator=gen), torch.tensor(n))
                               for n in ([3, 1, 2], [1, 3, 3], [2, 2, 1], [3, 3, 3])]]
    for n, (step_ids, num_new) in enumerate(steps):
        expected = model.forward(step_ids, contiguous, num_new=num_new)  # [3, T, V]
        got = model.forward(step_ids, paged, num_new=num_new)
        for b in range(3):
            valid = int(num_new[b])
            torch.testing.assert_close(got[b, :valid], expected[b, :valid], rtol=1e-5, atol=1e-5)
        assert paged.lengths.tolist() == contiguous.lengths.tolist()
        if n == 2:
            cut = contiguous.lengths - torch.tensor([1, 0, 2])
            paged.truncate(cut)
            contiguous.truncate(cut)
        assert shared.used_blocks == sum(shared.blocks_for(x) for x in paged.lengths.tolist())


# ---- the offloaded engine ------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("draft", ["qwen2_draft", "self", None])
def test_offloaded_engine_on_paged_kv_matches_the_resident_engine(tiny_models, resident_greedy, draft) -> None:
    """The attention worker's caches are PagedKVCaches over one pool sized by the placement (a self-drafter drafts
    into them through scratch views); greedy output equals the resident engine's, and every block is back in the
    pool once the job is done."""
    from specoffload.runtime.config import EngineConfig
    from specoffload.runtime.engine import Engine
    from specoffload.runtime.sampling import SamplingParams
    from tests.conftest import OFFLOAD_PROMPTS

    target = "qwen2_moe"
    config = EngineConfig(tiny_models[target], draft=tiny_models[draft] if draft == "qwen2_draft" else draft,
                          max_batch_size=3, max_seq_len=48, num_draft_tokens=3, device_memory="1GiB", kv_block_size=4)
    engine = Engine(config)
    attention = engine.workers.attention
    policy = engine.placement.policy
    assert attention.block_size() == 4 and policy.kv_block_size == 4
    assert attention.pool.num_blocks == policy.kv_blocks == policy.batch_size * policy.num_batches * 13  # 52 / 4
    kv_item = next(i.nbytes for i in engine.placement.items if i.name == "target KV cache")
    assert kv_item == attention.pool.nbytes()
    seen: list[object] = []
    original = attention.attention

    def spy(batch: int, layer: int, slot: int, hidden: torch.Tensor, token_mask: torch.Tensor | None = None,
            ) -> torch.Tensor:
        seen.append(type(attention.caches[batch]))
        return original(batch, layer, slot, hidden, token_mask)

    attention.attention = spy
    out = engine.generate(OFFLOAD_PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True))
    assert [r.token_ids for r in out] == resident_greedy(target)
    assert seen and set(seen) == {PagedKVCache}
    assert attention.free_blocks() == attention.pool.num_blocks and not attention.caches
    contiguous = Engine(replace(config, kv_block_size=0))
    assert contiguous.workers.attention.pool is None and contiguous.workers.attention.block_size() == 0


def test_kv_block_size_is_validated() -> None:
    from specoffload.runtime.config import ConfigError, EngineConfig

    # opt-in: paged attention copies K and V per layer (12-40% slower decode attention) and, until rows are admitted
    # and preempted by free blocks, buys no rows
    assert EngineConfig("unused").kv_block_size == 0 and EngineConfig("unused", kv_block_size=16).kv_block_size == 16
    for bad in (-1, True, 2.0, "16"):
        with pytest.raises(ConfigError, match="kv_block_size"):
            EngineConfig("unused", kv_block_size=bad)  # type: ignore[arg-type]


@pytest.mark.usefixtures("single_thread")
def test_cli_kv_block_size(tiny_models, tmp_path, capsys) -> None:
    """`specoffload generate --kv-block-size`: paged (4) and contiguous (0) caches write the same tokens."""
    import json

    from specoffload.runtime.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"token_ids": [5, 6, 7]}) + "\n" + json.dumps({"token_ids": [9, 4]}) + "\n")
    outputs = []
    for size in ("4", "0"):
        out = tmp_path / f"out{size}.jsonl"
        rc = main(["generate", "--target", str(tiny_models["llama"]), "--prompts", str(prompts), "--max-new-tokens",
                   "5", "--ignore-eos", "--no-progress", "--device-memory", "1000KiB", "--max-seq-len", "32",
                   "--batch-size", "2", "--kv-block-size", size, "-o", str(out), "--temperature", "0"])
        assert rc == 0, capsys.readouterr().err
        outputs.append([json.loads(line)["token_ids"] for line in out.read_text().splitlines()])
    assert outputs[0] == outputs[1] and all(len(t) == 5 for t in outputs[0])
