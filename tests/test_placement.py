"""Memory sizes and the pure placement function: literal cases, hypothesis properties, one real tiny checkpoint."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from specoffload.planner.errors import SpecOffloadError
from specoffload.planner.placement import (
    TIERS,
    ModelShape,
    Placement,
    PlacementError,
    PlacementPolicy,
    minimum_device_memory,
    packed_scratch_bytes,
    place,
    priority_order,
)
from specoffload.planner.units import MemorySizeError, format_bytes, machine_memory_bytes, parse_bytes
from specoffload.runtime.models.checkpoint import Checkpoint
from specoffload.runtime.models.config import ModelConfig
from specoffload.runtime.models.weights import PartKey, WeightLoader

GiB = 1024**3
FFN_KINDS = ("dense_mlp", "expert")

# --- memory sizes -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (1234, 1234),
        ("1234", 1234),
        ("12B", 12),
        ("4GiB", 4 * GiB),
        ("4 gib", 4 * GiB),
        ("512MiB", 512 * 1024**2),
        ("1.5GB", 1_500_000_000),
        ("2G", 2_000_000_000),
        ("3k", 3000),
        ("3KB", 3000),
        ("3KiB", 3072),
        ("1M", 10**6),
        ("1 TiB", 1024**4),
        ("2tb", 2 * 10**12),
        (" 0.5KiB ", 512),
        ("1.0", 1),
    ],
)
def test_parse_bytes(text: int | str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "4 GiBs", "-1GiB", "4 XB", "1.5", "1e9", "4 G i B", -1, True, 1.5, None])
def test_parse_bytes_rejects_bad_input_with_an_example(bad: object) -> None:
    with pytest.raises(MemorySizeError) as info:
        parse_bytes(bad)  # type: ignore[arg-type]
    assert isinstance(info.value, SpecOffloadError) and isinstance(info.value, ValueError)
    assert repr(bad) in str(info.value) or str(bad) in str(info.value)
    assert "4GiB" in str(info.value)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (12, "12 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (512 * 1024**2, "512.0 MiB"),
        (3 * GiB // 2, "1.50 GiB"),
        (10 * GiB, "10.0 GiB"),
        (2 * 1024**4, "2.00 TiB"),
        (-2048, "-2.00 KiB"),
    ],
)
def test_format_bytes(n: int, expected: str) -> None:
    assert format_bytes(n) == expected


def test_machine_memory_is_positive() -> None:
    assert machine_memory_bytes() > 64 * 1024**2


# --- synthetic models ---------------------------------------------------------------------------------------


def make_shape(
    name: str, layers: list[int], attn: int, ffn: int, embed: int, head: int, router: int = 10, kv: int = 8
) -> ModelShape:
    """layers[i] = experts of layer i (0 = dense); every expert / dense mlp has `ffn` bytes."""
    parts = [(PartKey("embedding"), embed)]
    for layer, experts in enumerate(layers):
        parts.append((PartKey("attention", layer), attn))
        if experts:
            parts.append((PartKey("router", layer), router))
            parts += [(PartKey("expert", layer, e), ffn) for e in range(experts)]
        else:
            parts.append((PartKey("dense_mlp", layer), ffn))
    parts.append((PartKey("head"), head))
    return ModelShape(name, tuple(parts), len(layers), kv)


@st.composite
def shapes(draw: st.DrawFn, name: str = "target", max_layers: int = 5) -> ModelShape:
    sizes = st.integers(0, 5000)
    num_layers = draw(st.integers(1, max_layers))
    parts = [(PartKey("embedding"), draw(sizes))]
    for layer in range(num_layers):
        parts.append((PartKey("attention", layer), draw(sizes)))
        experts = draw(st.integers(0, 4))
        if experts:
            parts.append((PartKey("router", layer), draw(st.integers(0, 100))))
            parts += [(PartKey("expert", layer, e), draw(sizes)) for e in range(experts)]
        else:
            parts.append((PartKey("dense_mlp", layer), draw(sizes)))
    parts.append((PartKey("head"), draw(sizes)))
    return ModelShape(name, tuple(parts), num_layers, draw(st.integers(0, 64)))


policies = st.builds(
    PlacementPolicy,
    batch_size=st.integers(1, 4),
    num_batches=st.sampled_from([1, 2]),
    kv_capacity=st.integers(1, 64),
    num_buffers=st.integers(1, 3),
    weights_tier=st.sampled_from(["disk", "ram"]),
    unified_memory=st.booleans(),
    expert_group=st.sampled_from([0, 0, 1, 2]),
)
drafts = st.none() | shapes(name="draft", max_layers=2)


def kv_bytes(shape: ModelShape, policy: PlacementPolicy) -> int:
    """The oracle of a KV cache's size, written out from its definition: K and V of every token of every row of
    every batch, at full capacity (not the production helper)."""
    return shape.kv_bytes_per_token * policy.kv_capacity * policy.batch_size * policy.num_batches


def weight_bytes(shape: ModelShape) -> int:
    return sum(nbytes for _, nbytes in shape.parts)


def host_ceiling(target: ModelShape, policy: PlacementPolicy) -> int:
    """Host memory that is always enough: the target KV cache plus (weights_tier "ram") every target weight."""
    return kv_bytes(target, policy) + (weight_bytes(target) if policy.weights_tier == "ram" else 0)


def footprint_oracle(target: ModelShape, draft: ModelShape | None, policy: PlacementPolicy,
                     tiers: dict[PartKey, str]) -> tuple[int, int]:
    """(device, host) bytes of a placement, from the module docstring's definition and the part tiers alone:
    device = draft weights + draft KV + resident target parts + num_buffers x the largest streamed slot group
    (a layer's streamed parts; the head alone), plus every host item under unified memory; host = target KV +
    target weights on "host"."""
    resident = sum(n for key, n in target.parts if tiers[key] == "device")
    groups: dict[tuple[int, int], int] = {}
    g = policy.expert_group
    for key, n in target.parts:
        if tiers[key] != "device" and key.kind != "embedding":  # a unit: a layer, or g of its experts
            group = (-1, 0) if key.kind == "head" else (key.layer, key.expert // g if key.kind == "expert" and g else 0)
            groups[group] = groups.get(group, 0) + n
    draft_bytes = weight_bytes(draft) + kv_bytes(draft, policy) if draft is not None else 0
    host = kv_bytes(target, policy) + sum(n for key, n in target.parts if tiers[key] == "host")
    device = draft_bytes + resident + policy.num_buffers * max(groups.values(), default=0)
    return device + (host if policy.unified_memory else 0), host


def resident(placement: Placement) -> set[PartKey]:
    return {key for key, tier in placement.tiers.items() if tier == "device"}


def slot_groups(target: ModelShape, placement: Placement) -> dict[tuple[int, int], int]:
    """Streamed bytes per load unit (layer, or g experts of it; head = num_layers), from the part tiers."""
    groups: dict[tuple[int, int], int] = {}
    g = placement.policy.expert_group
    for key, nbytes in target.parts:
        if placement.is_streamed(key):
            group = (target.num_layers, 0) if key.kind == "head" else (
                key.layer, key.expert // g if key.kind == "expert" and g else 0)
            groups[group] = groups.get(group, 0) + nbytes
    return groups


FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(target=shapes(), draft=drafts, policy=policies, extra=st.integers(0, 40_000), data=st.data())
def test_placement_fits_budgets_and_is_consistent(
    target: ModelShape, draft: ModelShape | None, policy: PlacementPolicy, extra: int, data: st.DataObject
) -> None:
    device = minimum_device_memory(target, draft, policy) + extra
    host = host_ceiling(target, policy) + data.draw(st.integers(0, 1000))
    p = place(target, draft, policy, device, host)

    assert p.device_bytes() <= device and p.host_bytes() <= host
    assert set(p.tiers) == {key for key, _ in target.parts} and set(p.tiers.values()) <= set(TIERS)
    if policy.weights_tier == "disk":
        assert all(p.tier(key) != "host" for key, _ in target.parts)
    assert all(tier == "device" or tier == policy.streamed_tier for tier in p.tiers.values())
    # the ring slot holds the largest streamed layer (and the head when it streams)
    groups = slot_groups(target, p)
    assert p.slot_bytes == max(groups.values(), default=0)
    assert p.streamed_layers == tuple(sorted({layer for layer, _ in groups}))
    ring = [item for item in p.items if item.name.startswith("ring buffers")]
    assert sum(item.nbytes for item in ring) == policy.num_buffers * p.slot_bytes
    # an FFN layer is resident or streamed whole
    for layer in range(target.num_layers):
        ffn_tiers = {p.tier(key) for key, _ in target.parts if key.layer == layer and key.kind in FFN_KINDS}
        assert len(ffn_tiers) == 1
    # the items account for every byte: draft, target weights, KV caches, ring
    draft_bytes = weight_bytes(draft) + kv_bytes(draft, policy) if draft else 0
    expected = draft_bytes + weight_bytes(target) + kv_bytes(target, policy) + policy.num_buffers * p.slot_bytes
    assert sum(item.nbytes for item in p.items) == expected
    # and the footprints are what the definition gives for these tiers
    assert (p.device_bytes(), p.host_bytes()) == footprint_oracle(target, draft, policy, dict(p.tiers))


@FAST
@given(target=shapes(), draft=drafts, policy=policies, a=st.integers(0, 30_000), b=st.integers(0, 30_000))
def test_more_budget_never_makes_fewer_parts_resident(
    target: ModelShape, draft: ModelShape | None, policy: PlacementPolicy, a: int, b: int
) -> None:
    host = host_ceiling(target, policy)
    low = place(target, draft, policy, minimum_device_memory(target, draft, policy) + a, host)
    high = place(target, draft, policy, low.device_memory + b, host + b)
    assert resident(low) <= resident(high)


@FAST
@given(target=shapes(), draft=drafts, policy=policies, short=st.integers(1, 10_000))
def test_below_minimum_raises_with_the_minimum(
    target: ModelShape, draft: ModelShape | None, policy: PlacementPolicy, short: int
) -> None:
    minimum = minimum_device_memory(target, draft, policy)
    assume(minimum >= 1)
    with pytest.raises(PlacementError) as info:
        place(target, draft, policy, max(0, minimum - short), host_ceiling(target, policy))
    message = str(info.value)
    assert format_bytes(minimum) in message and f"{minimum} bytes" in message
    assert "batch_size" in message and "device memory" in message
    # the minimum itself fits, exactly: the items add up to the footprint the search used
    assert place(target, draft, policy, minimum, host_ceiling(target, policy)).device_bytes() == minimum


@FAST
@given(target=shapes(), draft=drafts, policy=policies, extra=st.integers(0, 40_000))
def test_table_totals_equal_the_items(
    target: ModelShape, draft: ModelShape | None, policy: PlacementPolicy, extra: int
) -> None:
    p = place(target, draft, policy, minimum_device_memory(target, draft, policy) + extra, host_ceiling(target, policy))
    totals = p.bytes_by_tier()
    for tier in TIERS:
        assert totals[tier] == sum(item.nbytes for item in p.items if item.tier == tier)
        assert f"{tier:<6}  {format_bytes(totals[tier]):>10}" in p.table()
    unified_host = totals["host"] if policy.unified_memory else 0
    assert p.device_bytes() == totals["device"] + unified_host
    assert all(item.name in p.table() for item in p.items)
    summary = json.loads(json.dumps(p.to_dict()))
    assert summary["bytes_by_tier"] == totals and summary["device_bytes"] == p.device_bytes()
    assert sum(sum(counts.values()) for counts in summary["part_tiers"].values()) == len(target.parts)


@FAST
@given(target=shapes(), draft=drafts, policy=policies)
def test_huge_budget_makes_everything_resident(
    target: ModelShape, draft: ModelShape | None, policy: PlacementPolicy
) -> None:
    p = place(target, draft, policy, 10**12, 10**12)
    assert set(p.tiers.values()) == {"device"}
    assert p.streamed_layers == () and p.slot_bytes == 0
    assert not any(item.name.startswith("ring buffers") for item in p.items)
    assert not any(p.is_streamed(key) for key, _ in target.parts)


# --- literal cases ------------------------------------------------------------------------------------------


def moe_pair(num_layers: int = 6) -> tuple[ModelShape, ModelShape]:
    """MoE layers of 4 experts: attention 100, router 10, expert 300 (ffn layer 1200), embedding/head 1000.

    With batch_size 2, kv_capacity 16, two batches: target KV 8 * 16 * 2 * 2 = 512, draft KV 128, draft weights 100.
    """
    target = make_shape("moe", [4] * num_layers, attn=100, ffn=300, embed=1000, head=1000, kv=8)
    draft = make_shape("draft", [0], attn=20, ffn=20, embed=30, head=30, kv=2)
    return target, draft


def test_literal_budgets_walk_the_priority_order() -> None:
    target, draft = moe_pair()
    policy = PlacementPolicy(batch_size=2, kv_capacity=16)
    fixed = 100 + 128 + 512  # draft weights + draft KV + target KV (unified: counts against the device)
    # all streamed: slot = attention + router + 4 experts = 1310 (> head 1000)
    assert minimum_device_memory(target, draft, policy) == fixed + 2 * 1310
    p = place(target, draft, policy, fixed + 2 * 1310, 512)
    assert resident(p) == set() and p.slot_bytes == 1310 and p.streamed_layers == tuple(range(7))
    assert p.tier(PartKey("embedding")) == "disk" and not p.is_streamed(PartKey("embedding"))
    names = [item.name for item in p.items]
    assert "ring buffers 2 x 1.28 KiB" in names and "target embedding (rows read on demand)" in names
    assert "target experts (streamed, 6 layers, 24 experts)" in names and "target KV cache" in names
    # routers and attention resident: the slot is an ffn layer
    p = place(target, draft, policy, fixed + 660 + 2 * 1200, 512)
    assert {key.kind for key in resident(p)} == {"router", "attention"} and p.slot_bytes == 1200
    assert "target attention (6 layers)" in [item.name for item in p.items]
    # + the head
    p = place(target, draft, policy, fixed + 1660 + 2 * 1200, 512)
    assert p.tier(PartKey("head")) == "device" and p.streamed_layers == tuple(range(6))
    # + ffn layer 0, whole
    p = place(target, draft, policy, fixed + 2860 + 2 * 1200, 512)
    assert {p.tier(PartKey("expert", 0, e)) for e in range(4)} == {"device"}
    assert p.tier(PartKey("expert", 1, 0)) == "disk" and p.streamed_layers == (1, 2, 3, 4, 5)
    # everything but the embedding: no ring at all
    p = place(target, draft, policy, fixed + 1660 + 7200, 512)
    assert p.streamed_layers == () and p.slot_bytes == 0 and p.tier(PartKey("embedding")) == "disk"
    p = place(target, draft, policy, fixed + 2660 + 7200, 512)
    assert set(p.tiers.values()) == {"device"}


def test_minimum_is_the_cheapest_plan_not_always_all_streamed() -> None:
    # 2 layers, 3 buffers: the ring of 3 x 1310 costs more than keeping every layer resident
    target, draft = moe_pair(num_layers=2)
    policy = PlacementPolicy(batch_size=2, kv_capacity=16, num_buffers=3)
    fixed = 100 + 128 + 512
    assert minimum_device_memory(target, draft, policy) == fixed + 220 + 1000 + 2400 < fixed + 3 * 1310
    p = place(target, draft, policy, fixed + 3620, 512)
    assert p.streamed_layers == () and p.tier(PartKey("embedding")) == "disk"


def test_priority_order_is_routers_attention_head_ffn_embedding() -> None:
    target = make_shape("mixed", [0, 3], attn=1, ffn=1, embed=1, head=1)
    kinds = [tuple(key.kind for key in step) for step in priority_order(target)]
    assert kinds == [
        ("router",),
        ("attention",),
        ("attention",),
        ("head",),
        ("dense_mlp",),
        ("expert", "expert", "expert"),
        ("embedding",),
    ]


def test_a_head_goes_first_where_that_never_grows_a_plan() -> None:
    """Dense layers of 100 + 300 bytes and a head of 2000: streamed, the head sizes both slots (2 x 2000); made
    resident first it costs 2000 once and the slots shrink to a layer (2 x 400), so the cheapest plan is smaller
    than the all-streamed one, and a budget between the two keeps the head and streams the layers."""
    target = make_shape("dense", [0, 0, 0], attn=100, ffn=300, embed=50, head=2000)
    assert [step[0].kind for step in priority_order(target)][:2] == ["head", "attention"]
    policy = PlacementPolicy(batch_size=1, kv_capacity=4, num_batches=1)
    kv = 8 * 4
    assert minimum_device_memory(target, None, policy) == kv + 2000 + 2 * 400 < kv + 2 * 2000
    p = place(target, None, policy, kv + 2000 + 2 * 400, 10**9)
    assert resident(p) == {PartKey("head")} and p.slot_bytes == 400 and p.streamed_layers == (0, 1, 2)
    # a head that would make the first plan larger (400 < 600 < 2 x 400 with two buffers) keeps its place after the
    # attention; with three buffers 600 >= 1.5 x 400 takes it first
    mid = make_shape("dense", [0, 0, 0], attn=100, ffn=300, embed=50, head=600)
    assert [step[0].kind for step in priority_order(mid)][:4] == ["attention"] * 3 + ["head"]
    assert priority_order(mid, num_buffers=3)[0][0].kind == "head"
    assert priority_order(mid, num_buffers=1)[0][0].kind == "attention"  # one buffer: the ring shrinks by H - L < H
    # between the two plans (2 x 600 streamed, 600 + 2 x 400 resident) an attention fits beside the streamed head
    p = place(mid, None, policy, kv + 2 * 600 + 100, 10**9)
    assert resident(p) == {PartKey("attention", 0)} and p.slot_bytes == 600


@FAST
@given(target=shapes(), policy=policies, budget=st.integers(0, 60_000))
def test_head_first_never_keeps_less_resident(target: ModelShape, policy: PlacementPolicy, budget: int) -> None:
    """Against the order with the head after the attention (head_first patched off), at every budget: the plan fits
    whenever that one does, and keeps at least its resident bytes (the head-first rule never grows a plan)."""
    from unittest import mock

    from specoffload.planner import placement as module

    host = host_ceiling(target, policy)
    with mock.patch.object(module, "head_first", lambda *a, **k: False):
        try:
            before = place(target, None, policy, budget, host)
        except PlacementError:
            return
    after = place(target, None, policy, budget, host)
    held = dict(target.parts)
    assert sum(held[k] for k in resident(after)) >= sum(held[k] for k in resident(before))


def test_compressed_scratch_counts_only_what_streams() -> None:
    """The scratch for one load's compressed bytes is the largest *streamed* unit's: a compressed head made
    resident no longer sizes it (it did, as an upper bound, before)."""
    base = make_shape("dense", [0, 0, 0], attn=100, ffn=300, embed=50, head=2000)
    stored = tuple((key, n // 4) for key, n in base.parts if key.kind in ("dense_mlp", "head"))
    target = replace(base, stored=stored)
    policy = PlacementPolicy(batch_size=1, kv_capacity=4, num_batches=1)
    assert packed_scratch_bytes(target, policy) == 500
    assert packed_scratch_bytes(target, policy, {PartKey("head")}) == 75
    kv = 8 * 4
    minimum = minimum_device_memory(target, None, policy)
    assert minimum == kv + 2000 + 2 * 400 + 75
    p = place(target, None, policy, minimum, 10**9)
    items = {item.name: item.nbytes for item in p.items}
    assert resident(p) == {PartKey("head")}
    assert items["compressed bytes of one load (read before decompression)"] == 75 and p.device_bytes() == minimum


def test_host_memory_bounds_the_target_kv_cache() -> None:
    target, draft = moe_pair()
    policy = PlacementPolicy(batch_size=2, kv_capacity=16, unified_memory=False)
    with pytest.raises(PlacementError, match="512 B .512 bytes. of host memory"):
        place(target, draft, policy, 10**9, 511)
    assert place(target, draft, policy, 10**9, 512).host_bytes() == 512


def test_ram_tier_host_need_shrinks_as_the_device_budget_grows() -> None:
    target, draft = moe_pair()
    policy = PlacementPolicy(batch_size=2, kv_capacity=16, weights_tier="ram", unified_memory=False)
    minimum = minimum_device_memory(target, draft, policy)
    # with the device minimum, most weights stay in host RAM
    with pytest.raises(PlacementError, match="host memory") as info:
        place(target, draft, policy, minimum, 512)
    assert "weights_tier='disk'" in str(info.value)
    p = place(target, draft, policy, minimum, 10**9)
    assert p.tier(PartKey("expert", 0, 0)) == "host" and p.tier(PartKey("embedding")) == "host"
    # a device budget for everything leaves only the KV cache on the host
    p = place(target, draft, policy, 10**9, 512)
    assert p.bytes_by_tier() == {"device": p.device_bytes(), "host": 512, "disk": 0}


def test_unified_ram_tier_counts_host_weights_against_the_device() -> None:
    target, draft = moe_pair()
    policy = PlacementPolicy(batch_size=2, kv_capacity=16, weights_tier="ram", unified_memory=True)
    # one pool: every weight is in it either way, so the cheapest plan is everything resident, no ring
    assert minimum_device_memory(target, draft, policy) == 100 + 128 + 512 + target.total_bytes
    p = place(target, draft, policy, minimum_device_memory(target, draft, policy), 10**9)
    assert p.streamed_layers == () and set(p.tiers.values()) == {"device"}


def test_unknown_part_and_placement_is_frozen() -> None:
    target, draft = moe_pair()
    p = place(target, draft, PlacementPolicy(batch_size=1), 10**9, 10**9)
    with pytest.raises(KeyError, match="not a part"):
        p.tier(PartKey("expert", 0, 99))
    with pytest.raises(TypeError):
        p.tiers[PartKey("head")] = "disk"  # type: ignore[index]
    assert hash(p) == hash(place(target, draft, PlacementPolicy(batch_size=1), 10**9, 10**9))


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"batch_size": 0}, "batch_size must be an integer >= 1"),
        ({"batch_size": 1, "num_batches": 3}, "num_batches must be 1"),
        ({"batch_size": 1, "num_buffers": 0}, "num_buffers must be an integer >= 1"),
        ({"batch_size": 1, "kv_capacity": 0}, "kv_capacity must be an integer >= 1"),
        ({"batch_size": 1, "weights_tier": "gpu"}, "weights_tier must be 'disk'"),
        ({"batch_size": 2.0}, "batch_size must be an integer"),
    ],
)
def test_policy_validation(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(PlacementError, match=fragment):
        PlacementPolicy(**kwargs)  # type: ignore[arg-type]


def test_model_shape_rejects_bad_parts() -> None:
    with pytest.raises(ValueError, match="outside layers"):
        ModelShape("m", ((PartKey("attention", 2), 1),), 2, 0)
    with pytest.raises(ValueError, match="unknown part kind"):
        ModelShape("m", ((PartKey("lora", 0), 1),), 1, 0)
    with pytest.raises(ValueError, match="twice"):
        ModelShape("m", ((PartKey("head"), 1), (PartKey("head"), 1)), 0, 0)


# --- a real tiny checkpoint ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mixtral", "llama"])
def test_from_loader_on_a_tiny_checkpoint(tiny_models: dict, name: str) -> None:
    path = tiny_models[name]
    config = ModelConfig.from_dir(path)
    loader = WeightLoader(Checkpoint(path), config, torch.float32, "cpu")
    shape = loader.shape(name)
    assert [key for key, _ in shape.parts] == loader.parts()
    assert shape.total_bytes == loader.total_nbytes()
    assert shape.num_layers == config.num_layers
    assert shape.kv_bytes_per_token == 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4

    policy = PlacementPolicy(batch_size=2, num_batches=1, kv_capacity=32)
    minimum = minimum_device_memory(shape, None, policy)
    tight = place(shape, None, policy, minimum, 10**9)
    assert tight.streamed_layers and tight.device_bytes() <= minimum
    assert tight.tier(PartKey("embedding")) == "disk"
    everything = place(shape, None, policy, 10**9, 10**9)
    assert everything.streamed_layers == () and everything.device_bytes() == weight_bytes(shape) + kv_bytes(
        shape, policy
    )


@pytest.mark.parametrize("n", [1, 2, 5, 8, 12, 28, 61])
def test_spread_order_is_a_permutation_whose_prefixes_spread(n):
    from specoffload.planner.placement import spread_order

    order = spread_order(n)
    assert sorted(order) == list(range(n))
    if n >= 8:  # the first quarter of the resident layers covers every half of the model
        first = order[: n // 4]
        assert any(i < n // 2 for i in first) and any(i >= n // 2 for i in first)
        # no run of streamed layers longer than ~2x the even spacing once half the layers are resident
        resident = sorted(order[: n // 2])
        gaps = [b - a for a, b in zip(resident, resident[1:])]
        assert max(gaps) <= 4


@FAST
@given(target=shapes(), draft=drafts, policy=policies, extra=st.integers(0, 40_000))
def test_pinned_parts_are_resident_in_every_plan_and_counted_once(
    target: ModelShape, draft: ModelShape | None, policy: PlacementPolicy, extra: int
) -> None:
    """A drafter that shares the target's attention and routers pins them: they are resident whatever the budget,
    the footprint is still what the tiers give (each byte once), and the minimum never drops below them."""
    from dataclasses import replace

    pinned = frozenset(key for key, _ in target.parts if key.kind in ("attention", "router"))
    pinned_policy = replace(policy, pinned=pinned)
    minimum = minimum_device_memory(target, draft, pinned_policy)
    assert minimum >= minimum_device_memory(target, draft, policy)
    p = place(target, draft, pinned_policy, minimum + extra, host_ceiling(target, policy))
    assert all(p.tier(key) == "device" for key in pinned)
    assert (p.device_bytes(), p.host_bytes()) == footprint_oracle(target, draft, pinned_policy, dict(p.tiers))


def test_expert_groups_size_the_ring_per_group() -> None:
    """Layers of 4 experts x 300 B with attention 100 B and a 10 B router: a whole-layer slot is 1310 B; in units
    of 2 experts the first unit holds the attention and router too (710 B) and the head (1000 B) is the largest
    unit. All streamed, two buffers: the ring drops from 2 x 1310 to 2 x 1000."""
    target, draft = moe_pair()
    fixed = 100 + 128 + 512
    whole = PlacementPolicy(batch_size=2, kv_capacity=16)
    grouped = PlacementPolicy(batch_size=2, kv_capacity=16, expert_group=2)
    assert minimum_device_memory(target, draft, whole) == fixed + 2 * 1310
    assert minimum_device_memory(target, draft, grouped) == fixed + 2 * 1000
    p = place(target, draft, grouped, fixed + 2 * 1000, 512)
    assert p.slot_bytes == 1000 and p.streamed_layers == tuple(range(7))
    assert "ring buffers 2 x 1000 B (units of 2 experts)" in [item.name for item in p.items]
    with pytest.raises(PlacementError, match="expert_group"):
        PlacementPolicy(batch_size=1, expert_group=-1)


def test_a_budget_too_small_names_the_knob_that_helps() -> None:
    """Below the floor (one row, one buffer, no draft) only a larger budget helps, and the message says so with the
    floor; above it, a smaller batch or ring helps, and the message names the budget this policy needs."""
    from dataclasses import replace

    from tests.conftest import dense_shape

    target = dense_shape("t", layers=4, attention=1000, mlp=50_000, head=20_000, embedding=20_000, kv=64)
    policy = PlacementPolicy(batch_size=8, num_batches=1, kv_capacity=256, num_buffers=2)
    floor = minimum_device_memory(target, None, replace(policy, batch_size=1, num_buffers=1))
    needed = minimum_device_memory(target, None, policy)
    assert floor < needed
    with pytest.raises(PlacementError, match=f"raise device_memory to at least {format_bytes(floor)}"):
        place(target, None, policy, floor - 1, 10**12)
    with pytest.raises(PlacementError, match=f"lower batch_size, .* or raise device_memory to {format_bytes(needed)}"):
        place(target, None, policy, floor + 1, 10**12)


@FAST
@given(target=shapes(), policy=policies, extra=st.integers(0, 40_000), share=st.integers(0, 100))
def test_a_stand_in_draft_holds_copies_of_the_streamed_parts_only(
    target: ModelShape, policy: PlacementPolicy, extra: int, share: int
) -> None:
    """A draft whose parts stand in for the target's (the low-bit drafter's copies, share% of each part's bytes)
    pays for a copy only while its target part streams: the chain's footprint and the items agree, at the minimum
    exactly, and the draft's item is the copies of the streamed parts."""
    copies = tuple((key, n * share // 100) for key, n in target.parts if key.kind != "embedding")
    draft = ModelShape("stand-in", copies, target.num_layers, 0, stands_in=True)
    minimum = minimum_device_memory(target, draft, policy)
    host = host_ceiling(target, policy)
    assert place(target, draft, policy, minimum, host).device_bytes() == minimum
    p = place(target, draft, policy, minimum + extra, host)
    assert p.device_bytes() <= minimum + extra
    held = sum(n for key, n in copies if p.tier(key) != "device")
    items = {item.name: item.nbytes for item in p.items}
    assert items["draft weights"] == held == draft.held_bytes(resident(p))
    # the longest prefix of the priority steps that fits, by the definition (the next step would not fit)
    steps = priority_order(target, policy.pinned, policy.expert_group, policy.num_buffers)
    chosen = [step for step in steps if all(p.tier(key) == "device" for key in step)]
    if len(chosen) < len(steps):
        tiers = {key: "device" if key in resident(p) or key in steps[len(chosen)] else policy.streamed_tier
                 for key, _ in target.parts}
        device, host_bytes = footprint_oracle(target, None, policy, tiers)
        device += sum(n for key, n in copies if tiers[key] != "device")
        assert device > minimum + extra or host_bytes > host
    plain = replace(draft, stands_in=False)  # the same bytes held whatever the target keeps: never cheaper
    assert minimum_device_memory(target, plain, policy) >= minimum
