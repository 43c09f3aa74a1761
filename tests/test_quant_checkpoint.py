"""Compressed checkpoints: `specoffload quantize`, the reader's layout checks, streaming them, and lossless
speculation relative to the compressed target."""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from specoffload.planner.shapes import PartKey
from specoffload.runtime.cli import main
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.formats import FORMATS, WeightFormat, register_format, weight_format
from specoffload.runtime.models.checkpoint import Checkpoint
from specoffload.runtime.models.errors import CheckpointError
from specoffload.runtime.models.model import Transformer
from specoffload.runtime.offload.streamer import WeightStreamer
from specoffload.runtime.quantize import quantize_checkpoint
from specoffload.runtime.sampling import SamplingParams
from tests.conftest import OFFLOAD_PROMPTS, needs_int4_kernel

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
# group 32: the tiny models' FFN widths are 96, 128, 32 and 48 (the last pads its second group)
SPECS = {"int8": weight_format("int8"), "int4": weight_format("int4", 32), "int4k": weight_format("int4k", 32),
         "int8g": weight_format("int8g", 32)}


@pytest.fixture(scope="session")
def quantized(tiny_models, tmp_path_factory):
    """(model, scheme) -> compressed checkpoint dir, built once."""
    root = tmp_path_factory.mktemp("quantized")
    built: dict[tuple[str, str], Path] = {}

    def get(name: str, scheme: str) -> Path:
        if (name, scheme) not in built:
            built[name, scheme] = root / f"{name}-{scheme}"
            quantize_checkpoint(tiny_models[name], built[name, scheme], SPECS[scheme])
        return built[name, scheme]

    return get


def _greedy(config: EngineConfig) -> list[list[int]]:
    return [r.token_ids for r in Engine(config).generate(OFFLOAD_PROMPTS, GREEDY)]


def test_cli_writes_a_checkpoint_with_provenance_and_adjacent_components(tiny_models, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(tiny_models["qwen2_moe"]), "--to", "int4", "--group", "32",
                 "-o", str(out)]) == 0
    record = json.loads((out / "provenance.json").read_text())
    assert record["scheme"] == "int4" and record["group_size"] == 32
    assert set(record["source"]["sha256"]) >= {"config.json", "model.safetensors"}
    assert record["safetensors_sha256"].keys() == {"model.safetensors"}
    assert record["bytes"]["stored"] < record["bytes"]["source"]
    assert "built_at" in record
    ckpt = Checkpoint(out)
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    assert ckpt.quantized(name) is not None and ckpt.quantized("model.layers.0.mlp.gate.weight") is None
    assert ckpt.quantized("model.layers.0.mlp.shared_expert.down_proj.weight") is not None
    assert name in ckpt.names() and f"{name}.qweight" not in ckpt.names()
    comps = ckpt.quantized(name).components
    for a, b in zip(comps, comps[1:]):  # stored next to each other: one read fetches them
        assert a.location.offset + a.location.length == b.location.offset
    original = Checkpoint(tiny_models["qwen2_moe"])
    assert ckpt.shape(name) == original.shape(name)
    step = ckpt.get(f"{name}.scale").float().repeat_interleave(32, -1)
    assert ((ckpt.get(name) - original.get(name, torch.float32)).abs() <= step / 2 + 1e-6).all()
    assert main(["quantize", "--model", str(tiny_models["qwen2_moe"]), "--to", "int4", "-o", str(out)]) == 2
    assert "exists" in capsys.readouterr().err


def _rewrite_header(file: Path, edit) -> None:
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    file.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n :])


@pytest.mark.parametrize("damage, message", [
    ("scale_dtype", r"\.scale is F32 \[64, 2\], but int4, group 32 of a \[64, 48\] weight stores F16 \[64, 2\]"),
    ("group", None),
    ("missing", r"\.zero is missing"),
    ("manifest", r"corrupt .*quantization.json"),
    ("no_manifest", r"holds compressed tensors .* but no quantization.json"),
])
def test_reader_refuses_a_damaged_layout_with_one_line(quantized, tmp_path, monkeypatch, damage, message):
    monkeypatch.setenv("SPECOFFLOAD_SKIP_HASH_CHECK", "1")  # (the file no longer has its recorded hash: the layout
    ckpt = tmp_path / "bad"  # check under that is what is tested here)
    shutil.copytree(quantized("qwen2_moe", "int4"), ckpt)
    name = "model.layers.0.mlp.shared_expert.down_proj.weight"  # [64, 48]: two groups of 32, the last padded
    st, manifest = ckpt / "model.safetensors", ckpt / "quantization.json"
    if damage == "scale_dtype":
        def edit(h):
            h[f"{name}.scale"]["dtype"] = "F32"
            h[f"{name}.scale"]["shape"] = [32, 2]  # same bytes
        _rewrite_header(st, edit)
        message = message.replace(r"F32 \[64, 2\]", r"F32 \[32, 2\]")
    elif damage == "group":
        m = json.loads(manifest.read_text())
        m["group_size"] = 16
        manifest.write_text(json.dumps(m))
        message = r"\.scale is F16 \[64, 1\], but int4, group 16 of a \[64, 32\] weight stores F16 \[64, 2\]"
    elif damage == "missing":
        _rewrite_header(st, lambda h: h.pop(f"{name}.zero"))  # its bytes become a hole
    elif damage == "manifest":
        manifest.write_text("{not json")
    else:
        manifest.unlink()
    with pytest.raises(CheckpointError, match=message) as err:
        Checkpoint(ckpt)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("source", ["disk", "ram"])
@pytest.mark.parametrize("model, scheme", [("qwen2_moe", "int4"), ("mixtral_fused", "int8"), ("llama", "int4"),
                                           ("qwen2_moe", "int4k"), ("mixtral_fused", "int4k"), ("qwen2_moe", "int8g"),
                                           ("mixtral_fused", "int8g")])
def test_streamer_decompresses_into_the_slot_exactly_as_the_resident_loader(quantized, source, model, scheme,
                                                                           single_thread):
    target = Transformer(quantized(model, scheme))
    keys = [k for k in target.loader.parts() if k.kind in ("dense_mlp", "expert", "router")][:6]
    slot_bytes = sum(WeightStreamer(target.loader, 1, 1, "disk", "cpu").nbytes([k]) for k in keys)
    with WeightStreamer(target.loader, slot_bytes, 2, source, "cpu", parts=keys, staging_bytes=8192) as s:
        for _ in range(2):  # the scratch and slots are reused
            got = s.load(1, keys)
            for key in keys:
                want = target.loader.load(key)
                assert repr(got[key]) is not None
                _assert_same(got[key], want)
        stored = s.stored_nbytes(keys)
        assert stored < s.nbytes(keys)  # compressed bytes, not the compute dtype's
        assert s.decompress_seconds > 0
        if source == "ram":
            assert s.bytes_read == 2 * stored


def _assert_same(a, b) -> None:
    import dataclasses

    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f.name
        elif dataclasses.is_dataclass(x):
            _assert_same(x, y)


@pytest.mark.parametrize("target, scheme", [("llama", "int4"), ("qwen2_moe", "int4"), ("mixtral_fused", "int8"),
                                            ("llama", "int8g")])
def test_offloaded_compressed_target_matches_resident_and_draft_is_lossless(tiny_models, quantized, target, scheme,
                                                                             single_thread):
    ckpt = quantized(target, scheme)
    base = dict(target=ckpt, max_batch_size=3, max_seq_len=48)
    resident = _greedy(EngineConfig(**base))
    original = _greedy(EngineConfig(**(base | {"target": tiny_models[target]})))
    assert resident != original or scheme in ("int8", "int8g")  # the compression is real on these tiny random models
    for draft in (None, tiny_models["qwen2_draft"], quantized("qwen2_draft", "int8")):
        for tier in ("disk", "ram"):
            extra = {"host_memory": "1GiB"} if tier == "ram" else {}
            config = EngineConfig(**base, draft=draft, num_draft_tokens=3 if draft else 0, device_memory="1GiB",
                                  weights_tier=tier, **extra)
            lo = Engine(config).minimum_device_memory()
            engine = Engine(replace(config, device_memory=lo))
            out = [r.token_ids for r in engine.generate(OFFLOAD_PROMPTS, GREEDY)]
            assert engine.placement.streamed_layers
            assert out == resident, f"draft {draft}, tier {tier}"
    # resident speculation on the compressed target: the same greedy tokens
    assert _greedy(EngineConfig(**base, draft=quantized("qwen2_draft", "int4"), num_draft_tokens=3)) == resident


def test_sampled_output_of_a_compressed_target_is_the_same_offloaded_and_resident(quantized, single_thread):
    ckpt = quantized("qwen2_moe", "int4")
    params = SamplingParams(max_new_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    base = dict(target=ckpt, max_batch_size=3, max_seq_len=48)
    resident = [r.token_ids for r in Engine(EngineConfig(**base)).generate(OFFLOAD_PROMPTS, params)]
    lo = Engine(EngineConfig(**base, device_memory="1GiB")).minimum_device_memory()
    offloaded = [r.token_ids for r in Engine(EngineConfig(**base, device_memory=lo)).generate(OFFLOAD_PROMPTS, params)]
    assert offloaded == resident


def test_a_compressed_checkpoint_is_refused_as_source(quantized, tmp_path):
    with pytest.raises(CheckpointError, match="already compressed"):
        quantize_checkpoint(quantized("llama", "int8"), tmp_path / "x", weight_format("int8"))


def test_part_keys_of_the_router_stay_uncompressed(quantized):
    loader = Transformer(quantized("qwen2_moe", "int8")).loader
    ckpt = loader.checkpoint
    refs = loader.refs(PartKey("router", 0))
    assert ckpt.quantized(refs["gate"].name) is None and ckpt.quantized(refs["shared_gate_proj"].name) is not None


def test_cli_user_mistakes_are_one_line_errors(tiny_models, tmp_path, capsys):
    model = str(tiny_models["llama"])
    assert main(["quantize", "--model", model, "--to", "int4", "--group", "63", "-o", str(tmp_path / "a")]) == 2
    assert main(["quantize", "--model", model, "--to", "int8", "--group", "64", "-o", str(tmp_path / "b")]) == 2
    assert main(["quantize", "--model", str(tmp_path / "missing"), "--to", "int8", "-o", str(tmp_path / "c")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("specoffload: error: ") for line in lines)
    assert "even group" in lines[0] and "int8g is int8 per group" in lines[1]
    assert not any(p.exists() for p in (tmp_path / "a", tmp_path / "b", tmp_path / "c"))


def test_a_compressed_checkpoint_passes_the_size_check_when_its_weights_dominate(tmp_path):
    """The checkpoint check (runtime/models/validate.py) bounds the weights a config implies by the files' bytes; a
    compressed copy is smaller than 2 bytes per weight, and must still open (found on the moefied MoE, whose experts
    dominate its bytes, where the tiny test models' embeddings hid it)."""
    import torch
    from safetensors.torch import save_file

    from specoffload.runtime.formats import weight_format
    from specoffload.runtime.models.checkpoint import Checkpoint
    from specoffload.runtime.models.config import ModelConfig
    from specoffload.runtime.models.validate import validate_checkpoint
    from specoffload.runtime.quantize import quantize_checkpoint

    src = tmp_path / "src"
    src.mkdir()
    h, inter, vocab = 16, 512, 8  # a tiny vocabulary: the MLPs are nearly all of the bytes
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": inter,
           "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": vocab,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 1e4, "hidden_act": "silu",
           "tie_word_embeddings": False, "torch_dtype": "float16"}
    (src / "config.json").write_text(json.dumps(cfg))
    t = {"model.embed_tokens.weight": torch.randn(vocab, h), "model.norm.weight": torch.ones(h),
         "lm_head.weight": torch.randn(vocab, h)}
    for j in range(2):
        p = f"model.layers.{j}"
        t |= {f"{p}.self_attn.q_proj.weight": torch.randn(h, h), f"{p}.self_attn.k_proj.weight": torch.randn(8, h),
              f"{p}.self_attn.v_proj.weight": torch.randn(8, h), f"{p}.self_attn.o_proj.weight": torch.randn(h, h),
              f"{p}.input_layernorm.weight": torch.ones(h), f"{p}.post_attention_layernorm.weight": torch.ones(h),
              f"{p}.mlp.gate_proj.weight": torch.randn(inter, h), f"{p}.mlp.up_proj.weight": torch.randn(inter, h),
              f"{p}.mlp.down_proj.weight": torch.randn(h, inter)}
    save_file({k: v.half().contiguous() for k, v in t.items()}, src / "model.safetensors")
    for spec in (weight_format("int8"), weight_format("int4", 16)):
        out = tmp_path / spec.name
        quantize_checkpoint(src, out, spec)
        validate_checkpoint(Checkpoint(out), ModelConfig.from_dir(out))  # no CheckpointError


@dataclass(frozen=True)
class Int8Rows(WeightFormat):
    """A toy format declared in this test file alone: int8 codes with one float16 scale per row (as "int8" but a
    float16 scale), to show that a format is one class: quantize, checkpoint manifest, streaming and the resident
    load all take it from the registry."""

    name = "test-int8rows"

    def components(self, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {"qweight": ("I8", tuple(shape)), "scale": ("F16", (*shape[:-1], 1))}

    def quantize_rows(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = (x.abs().amax(dim=-1, keepdim=True) / 127).to(torch.float16).clamp_min(1e-4)  # [..., 1]
        return {"qweight": (x / scale.float()).round().clamp(-127, 127).to(torch.int8), "scale": scale}

    def dequantize_rows(self, dest: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return dest.copy_(parts["qweight"]).mul_(parts["scale"].float())


def test_a_format_declared_in_a_test_file_quantizes_streams_and_loads(tiny_models, tmp_path, single_thread):
    register_format(Int8Rows)
    try:
        out = tmp_path / "q"
        quantize_checkpoint(tiny_models["llama"], out, weight_format("test-int8rows"))
        assert json.loads((out / "quantization.json").read_text())["scheme"] == "test-int8rows"
        base = dict(target=out, max_batch_size=3, max_seq_len=48)
        resident = _greedy(EngineConfig(**base))
        lo = Engine(EngineConfig(**base, device_memory="1GiB")).minimum_device_memory()
        engine = Engine(EngineConfig(**base, device_memory=lo))
        assert engine.placement.streamed_layers
        assert [r.token_ids for r in engine.generate(OFFLOAD_PROMPTS, GREEDY)] == resident
    finally:
        FORMATS.pop("test-int8rows", None)


@needs_int4_kernel
def test_the_untied_head_is_compressed_on_request_and_runs_packed(tiny_models, tmp_path, single_thread):
    """`quantize --head`: the LM head stored as int4k beside the FFN; resident (dequantized, or packed under a budget)
    and streamed at the minimum budget give the same greedy tokens (float32), the packed head is the kernel's weight,
    and it takes fewer bytes of the budget than the 16-bit head. A tied head (the embedding) is refused in one line."""
    from specoffload.runtime.models.packed import PackedInt4

    out = tmp_path / "head"
    assert main(["quantize", "--model", str(tiny_models["llama"]), "--to", "int4k", "--group", "32", "--head",
                 "-o", str(out)]) == 0
    record = json.loads((out / "provenance.json").read_text())
    assert record["compressed"] == "ffn+head"
    ckpt = Checkpoint(out)
    assert ckpt.quantized("lm_head.weight") is not None and ckpt.quantized("model.embed_tokens.weight") is None
    base = dict(target=out, max_batch_size=3, max_seq_len=48)
    resident = _greedy(EngineConfig(**base))
    engine = Engine(EngineConfig(**base, device_memory="1GiB", packed_weights="on"))
    assert isinstance(engine.pipeline.workers.verifier.model.resident[PartKey("head")].lm_head, PackedInt4)
    assert [r.token_ids for r in engine.generate(OFFLOAD_PROMPTS, GREEDY)] == resident
    packed_bytes = engine.placement.device_bytes()
    engine.close()
    plain = Engine(EngineConfig(**(base | {"target": tiny_models["llama"]}), device_memory="1GiB",
                                packed_weights="on"))
    assert packed_bytes < plain.placement.device_bytes()
    plain.close()
    config = EngineConfig(**base, device_memory="1GiB", packed_weights="slots")
    engine = Engine(replace(config, device_memory=Engine(config).minimum_device_memory()))
    assert engine.placement.is_streamed(PartKey("head"))
    assert [r.token_ids for r in engine.generate(OFFLOAD_PROMPTS, GREEDY)] == resident
    engine.close()
    assert main(["quantize", "--model", str(tiny_models["llama_tied"]), "--to", "int4k", "--head",
                 "-o", str(tmp_path / "tied")]) == 2
    assert not (tmp_path / "tied").exists()
