"""Compressed parts in the planner: the loader's time (read + decompression), the RAM tier's and the scratch's bytes,
the profile's new rates; and the runtime's shape of a compressed checkpoint. Literal numbers."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import pytest

from specoffload.planner.cost import ModelCosts, estimate_step, stream_seconds
from specoffload.planner.placement import Placement, PlacementPolicy, place
from specoffload.planner.profile import HardwareProfile, ProfileError
from specoffload.planner.shapes import ModelShape, PartKey
from tests.conftest import dense_shape
from tests.test_planner import make_profile

# 4 layers; bf16: mlp 800 bytes each. Compressed: each mlp stored as 200 bytes (int4-like)
TARGET = dense_shape("target", 4, attention=200, mlp=800, head=400, embedding=1000, kv=16)
COMPRESSED = replace(TARGET, stored=tuple((PartKey("dense_mlp", j), 200) for j in range(4)))
COSTS = ModelCosts.from_shapes(COMPRESSED, None, dtype_bytes=2)


def _streamed(shape: ModelShape, weights_tier: str = "disk") -> Placement:
    tiers = {key: ("disk" if key.kind == "dense_mlp" else "device") for key, _ in shape.parts}
    policy = PlacementPolicy(batch_size=1, num_buffers=2, weights_tier=weights_tier)
    return Placement(MappingProxyType(tiers), (0, 1, 2, 3), 800, 2, policy, (), 0, 0)


def test_load_seconds_reads_stored_bytes_then_decompresses() -> None:
    p = make_profile(read_bytes_per_s=400.0, decompress_bytes_per_s=1600.0)
    assert p.load_seconds(800) == pytest.approx(1.0)  # stored as computed: the stream rate (800 B/s)
    assert p.load_seconds(800, 200) == pytest.approx(200 / 400 + 800 / 1600)
    assert replace(p, read_bytes_per_s=None).load_seconds(800, 200) == pytest.approx(0.5)  # RAM tier: no read
    assert make_profile().load_seconds(800, 200) == pytest.approx(1.0)  # not measured: priced as any part
    scaled = p.scaled_io(2.0)
    assert (scaled.stream_bytes_per_s, scaled.read_bytes_per_s, scaled.decompress_bytes_per_s) == (1600, 800, 3200)
    with pytest.raises(ProfileError, match="decompress_bytes_per_s"):
        make_profile(decompress_bytes_per_s=0.0)


def test_profile_json_keeps_the_compression_rates(tmp_path) -> None:  # noqa: ANN001
    p = make_profile(read_bytes_per_s=400.0, decompress_bytes_per_s=1600.0)
    p.save(tmp_path / "p.json")
    q = HardwareProfile.load(tmp_path / "p.json")
    assert (q.read_bytes_per_s, q.decompress_bytes_per_s) == (400.0, 1600.0)


def test_step_io_of_a_compressed_target() -> None:
    p = make_profile(read_bytes_per_s=400.0, decompress_bytes_per_s=1600.0)
    placement = _streamed(COMPRESSED)
    assert stream_seconds(p, placement, COMPRESSED) == pytest.approx({(j, 0): 1.0 for j in range(4)})
    step = estimate_step(p, COSTS, placement, batch=1, k=0, alpha=0.5, attended_len=8)
    assert step.t_io == pytest.approx(4 * (0.5 + 0.5))
    fast = make_profile(read_bytes_per_s=800.0, decompress_bytes_per_s=8000.0)
    step = estimate_step(fast, COSTS, placement, batch=1, k=0, alpha=0.5, attended_len=8)
    assert step.t_io == pytest.approx(4 * (0.25 + 0.1))  # 2.9x less than the 4 s of the uncompressed model


def test_placement_counts_stored_bytes_off_the_device_and_the_scratch() -> None:
    policy = PlacementPolicy(batch_size=1, num_buffers=2, weights_tier="ram", unified_memory=False)
    plain = place(TARGET, None, policy, device_memory=3000, host_memory=10**6)
    packed = place(COMPRESSED, None, policy, device_memory=3000, host_memory=10**6)
    assert plain.streamed_layers == packed.streamed_layers and plain.streamed_layers
    streamed = len(plain.streamed_layers)
    assert plain.host_bytes() - packed.host_bytes() == streamed * (800 - 200)  # the RAM tier holds them compressed
    disk = place(COMPRESSED, None, replace(policy, weights_tier="disk"), device_memory=3200, host_memory=10**6)
    assert any(i.name.startswith("compressed bytes of one load") and i.nbytes == 200 for i in disk.items)
    assert disk.device_bytes() == sum(i.nbytes for i in disk.items if i.tier == "device")
    with pytest.raises(ValueError, match="stored bytes"):
        ModelShape("x", TARGET.parts, 4, 16, stored=((PartKey("expert", 0, 0), 5),))


def test_packed_parts_take_their_slot_bytes_in_the_ring_and_their_full_bytes_resident() -> None:
    """int8 weights kept packed in the ring slots (runtime/models/packed.py): a streamed mlp takes 420 bytes in a
    slot instead of 800, so the ring shrinks; a resident one is dequantized, so it still takes 800."""
    packed = replace(COMPRESSED, slotted=tuple((PartKey("dense_mlp", j), 420) for j in range(4)))
    policy = PlacementPolicy(batch_size=1, num_buffers=2, weights_tier="disk", unified_memory=False)
    plain = place(COMPRESSED, None, policy, device_memory=3200, host_memory=10**6)
    small = place(packed, None, policy, device_memory=3200, host_memory=10**6)
    assert plain.slot_bytes == 800 and small.slot_bytes == 420
    assert small.device_bytes() == sum(i.nbytes for i in small.items if i.tier == "device")
    # the smaller ring leaves room for one mlp resident, at its full (dequantized) bytes
    assert small.device_bytes() <= 3200 and len(small.streamed_layers) == len(plain.streamed_layers) - 1
    assert [i.nbytes for i in small.items if i.tier == "device" and i.name.startswith("target ffn")] == [800]
    with pytest.raises(ValueError, match="slot bytes"):
        ModelShape("x", TARGET.parts, 4, 16, slotted=((PartKey("expert", 0, 0), 5),))


def test_runtime_shape_of_a_compressed_checkpoint(tiny_models, tmp_path) -> None:  # noqa: ANN001
    from specoffload.runtime.formats import weight_format
    from specoffload.runtime.models.model import Transformer
    from specoffload.runtime.quantize import quantize_checkpoint

    out = tmp_path / "q"
    quantize_checkpoint(tiny_models["qwen2_moe"], out, weight_format("int4", 32))
    shape = Transformer(out).loader.shape("t")
    plain = Transformer(tiny_models["qwen2_moe"]).loader.shape("t")
    assert shape.parts == plain.parts  # slots hold the same compute-dtype weights
    stored = shape.stored_bytes()
    nbytes = dict(shape.parts)
    # every FFN part (routers: for the shared expert's matrices), nothing else
    assert {k.kind for k in stored} == {k.kind for k in nbytes if k.kind in ("expert", "router", "dense_mlp")}
    # fp32 compute: int4 at group 32 is 5 bits of 32 per weight, plus the uncompressed norms and gates
    assert all(stored[k] < nbytes[k] / 4 for k in stored if k.kind == "expert")


@pytest.mark.parametrize("tier", ["disk", "ram"])
def test_profiler_measures_the_loader_rates_of_a_compressed_checkpoint(tiny_models, tmp_path, tier) -> None:  # noqa: ANN001
    from specoffload.runtime.config import EngineConfig
    from specoffload.runtime.formats import weight_format
    from specoffload.runtime.models.model import Transformer
    from specoffload.runtime.offload.profiler import _stream_rate
    from specoffload.runtime.quantize import quantize_checkpoint

    out = tmp_path / "q"
    quantize_checkpoint(tiny_models["llama"], out, weight_format("int8"))
    config = EngineConfig(out, device_memory="1GiB", weights_tier=tier, host_memory="1GiB")
    stream, read, decompress = _stream_rate(config, Transformer(out), layers_to_load=2)
    assert stream > 0 and decompress is not None and decompress > 0
    assert (read is not None and read > 0) if tier == "disk" else read is None
    plain = _stream_rate(replace(config, target=tiny_models["llama"]), Transformer(tiny_models["llama"]), 2)
    assert plain[1:] == (None, None)  # nothing compressed: priced at the stream rate alone
