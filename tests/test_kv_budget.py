"""Paged target KV in the planner: the placement policy's block arithmetic, `kv_rows` (kv_rows_gain) and the
search placing by expected use, on literal numbers."""

from __future__ import annotations

import math

import pytest

from specoffload.planner import SearchSpace, Workload, search
from specoffload.planner.kv_budget import KVRows, expected_kv_tokens, kv_rows
from specoffload.planner.placement import PlacementError, PlacementPolicy, place
from tests.conftest import dense_shape
from tests.test_planner import make_profile

TARGET = dense_shape("target", 4, attention=200, mlp=800, head=400, embedding=1000, kv=16)
GiB = 1024**3


def test_policy_rounds_each_row_up_to_whole_blocks() -> None:
    contiguous = PlacementPolicy(batch_size=3, num_batches=2, kv_capacity=101)
    assert contiguous.target_kv_positions == 101 and contiguous.kv_blocks == 0
    assert contiguous.target_kv_cache_bytes(TARGET) == contiguous.kv_cache_bytes(TARGET) == 6 * 101 * 16

    paged = PlacementPolicy(batch_size=3, num_batches=2, kv_capacity=101, kv_block_size=16)
    assert paged.target_kv_positions == 112 and paged.kv_blocks == 6 * 7
    assert paged.target_kv_cache_bytes(TARGET) == (6 * 7 + 1) * 16 * 16  # (+1: the pool's sink block)
    assert paged.kv_cache_bytes(TARGET) == 6 * 101 * 16  # a draft's contiguous KV is unchanged

    expected = PlacementPolicy(batch_size=3, num_batches=2, kv_capacity=101, kv_block_size=16, kv_expected_tokens=40)
    assert expected.target_kv_positions == 48 and expected.kv_blocks == 6 * 3
    # never fewer blocks than one full-length row per batch (7 blocks of 16 for 101 positions): rows always progress
    short = PlacementPolicy(batch_size=1, num_batches=2, kv_capacity=101, kv_block_size=16, kv_expected_tokens=20)
    assert short.target_kv_positions == 32 and short.kv_blocks == 2 * 7
    capped = PlacementPolicy(batch_size=1, kv_capacity=101, kv_block_size=16, kv_expected_tokens=500)
    assert capped.target_kv_positions == 112  # never past the context
    ignored = PlacementPolicy(batch_size=1, kv_capacity=101, kv_expected_tokens=40)
    assert ignored.target_kv_positions == 101  # expected use only with blocks
    assert "kv_block_size=16, kv_expected_tokens=40" in expected.describe()
    with pytest.raises(PlacementError, match="kv_block_size"):
        PlacementPolicy(batch_size=1, kv_block_size=-1)
    with pytest.raises(PlacementError, match="kv_expected_tokens"):
        PlacementPolicy(batch_size=1, kv_expected_tokens=True)  # type: ignore[arg-type]


def test_placement_counts_the_paged_target_kv_on_the_host() -> None:
    policy = PlacementPolicy(batch_size=2, num_batches=1, kv_capacity=30, unified_memory=False, kv_block_size=8,
                             kv_expected_tokens=10)
    placement = place(TARGET, None, policy, GiB, GiB)
    # 2 rows x 2 blocks (and at least one row of 30 positions: 4 blocks) + the sink, x 8 positions x 16 bytes
    assert placement.host_bytes() == (4 + 1) * 8 * 16
    assert [i.nbytes for i in placement.items if i.name == "target KV cache"] == [640]
    with pytest.raises(PlacementError, match="640 B"):
        place(TARGET, None, policy, GiB, 639)


def test_expected_kv_tokens_and_rows_by_blocks_versus_by_max_seq_len() -> None:
    workload = Workload(num_prompts=100, prompt_len=99.5, new_tokens=200)
    assert expected_kv_tokens(workload, k_max=4) == 300 + 5
    assert expected_kv_tokens(workload, k_max=0, expected_new_tokens=50) == 150 + 1
    with pytest.raises(ValueError):
        expected_kv_tokens(workload, k_max=4, expected_new_tokens=201)

    rows = kv_rows(10**8, 1000, workload, max_seq_len=2048, k_max=4, block_size=16)
    # contiguous: 2048 + 5 = 2053 positions per row -> 48 rows; paged: 305 -> 320 positions -> 312 rows
    assert rows == KVRows(by_blocks=312, by_max_seq_len=48, positions_by_blocks=320, positions_by_max_seq_len=2053)
    assert rows.gain == 6.5
    early = kv_rows(10**8, 1000, workload, max_seq_len=2048, k_max=4, block_size=16, expected_new_tokens=50)
    assert (early.positions_by_blocks, early.by_blocks) == (160, 625)  # 155 -> 160 positions
    # a job whose rows use their whole max_seq_len gains nothing but the rounding to blocks
    full = kv_rows(10**6, 1, Workload(num_prompts=1, prompt_len=100, new_tokens=27), max_seq_len=127, k_max=0,
                   block_size=16)
    assert (full.by_max_seq_len, full.by_blocks, full.gain) == (7812, 7812, 1.0)
    assert KVRows(3, 0, 16, 4096).gain == math.inf and KVRows(0, 0, 16, 4096).gain == 1.0
    with pytest.raises(ValueError):
        kv_rows(10**6, 1000, workload, max_seq_len=2048, k_max=4, block_size=0)


def test_search_places_more_rows_by_expected_use() -> None:
    """Host memory bounds the target KV (16 bytes per position, 8000 bytes): at context 100 + 1 a row takes
    1616 bytes (4 rows fit); paged in blocks of 4 by the workload's expected 4 + 16 + 1 = 21 -> 24 positions, 384
    bytes a row (16 rows and the pool's sink block fit)."""
    workload = Workload(num_prompts=64, prompt_len=4, new_tokens=16)
    common = dict(alpha=0.8, device_memory=GiB, host_memory=8000, batches=(1, 2, 4, 8, 16, 32), ks=(0,),
                  unified_memory=False, max_seq_len=100)
    contiguous = search(make_profile(), SearchSpace(TARGET, None, workload, **common))
    rounded = search(make_profile(), SearchSpace(TARGET, None, workload, kv_block_size=4, **common))
    expected = search(make_profile(), SearchSpace(TARGET, None, workload, kv_block_size=4, kv_expected_use=True,
                                                  **common))
    assert {p.batch for p in contiguous.alternatives} == {1, 2, 4}
    assert {p.batch for p in rounded.alternatives} == {1, 2, 4}  # 104 positions: 1664 bytes a row
    assert {p.batch for p in expected.alternatives} == {1, 2, 4, 8, 16}
    assert next(p for p in expected.alternatives if p.batch == 16).memory["host"] == (16 * 24 // 4 + 1) * 4 * 16
