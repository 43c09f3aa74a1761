"""GGUF files run as stored (runtime/models/gguf.py, runtime/formats/ggml.py).

The block formats decode exactly as llama.cpp's reference (the gguf package's numpy implementation), bit for bit;
q4_0 / q4_k packed for the int4 kernel multiply as their dequantized weights do. Tiny Qwen2, Qwen3-MoE, Qwen2-MoE
(a shared expert, its gate a vector as llama.cpp's converter writes it) and Llama
(q / k rows permuted as llama.cpp's converter does, llama3 RoPE as its rope_freqs divisors) checkpoints written as
GGUF files of every readable type (scripts/make_tiny_gguf.py) run through the engine and
match transformers on the weights their blocks decode to (fp32 logits within 1e-4, greedy tokens identical), resident
and offloaded at the smallest budget (contiguous and block KV); speculation on a GGUF target is lossless.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants
from hypothesis import given, settings
from hypothesis import strategies as st

from specoffload.runtime.cli import main as cli_main
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.formats import FORMATS, dequantize, weight_format
from specoffload.runtime.formats.int4 import Int4
from specoffload.runtime.models.checkpoint import Checkpoint
from specoffload.runtime.models.errors import CheckpointError, UnsupportedModelError
from specoffload.runtime.models.gguf import GGUF_POINTER, gguf_file_in, resolve_model
from specoffload.runtime.models.model import Transformer
from specoffload.runtime.models.packed import int4_kernel_ok
from specoffload.runtime.offline.manifest import checkpoint_identity
from specoffload.runtime.offload.embedding import EmbeddingRows
from specoffload.runtime.sampling import SamplingParams
from tests.conftest import OFFLOAD_PROMPTS, offload_greedy, tight_config
from tests.test_engine import PROMPTS, hf_greedy
from tests.test_models import TOL, hf_logits, ragged_batch, rel_err

GGML = sorted(n for n, f in FORMATS.items() if not f.writable)
MODELS = ["qwen2_256", "qwen3_moe_256", "qwen2_moe_256", "llama"]

pytestmark = pytest.mark.usefixtures("single_thread")


def random_blocks(name: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    """Random bytes of `rows` x `blocks` blocks of format `name`, with finite, small float16 scales."""
    fmt = weight_format(name)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks, fmt.block_bytes), dtype=np.uint8)
    halves = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "mxfp4": ()}.get(name, (0,))
    for at in halves:
        d = rng.normal(0, 0.01, size=(rows, blocks)).astype(np.float16)
        raw[..., at : at + 2] = d[..., None].view(np.uint8).reshape(rows, blocks, 2)
    if name == "mxfp4":
        raw[..., 0] = rng.integers(100, 140, size=(rows, blocks))
    return raw.reshape(rows, -1)


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(GGML), rows=st.integers(1, 4), blocks=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_block_formats_decode_as_llama_cpp(name, rows, blocks, seed):
    fmt = weight_format(name)
    raw = random_blocks(name, rows, blocks, seed)
    assert (fmt.block, fmt.block_bytes) == GGML_QUANT_SIZES[GGMLQuantizationType[fmt.gguf_type]]
    ref = quants.dequantize(raw, GGMLQuantizationType[fmt.gguf_type])
    ours = dequantize({"qweight": torch.from_numpy(raw)}, fmt, (rows, blocks * fmt.block))
    assert np.array_equal(ours.numpy(), ref)
    for dtype in (torch.bfloat16, torch.float16):  # straight into a 16-bit slot: the same values, rounded once
        assert torch.equal(dequantize({"qweight": torch.from_numpy(raw)}, fmt, ours.shape, dtype), ours.to(dtype))
    if hasattr(fmt, "int4_parts"):  # q4_0 / q4_k as int4 group 32: the same weights
        parts = fmt.int4_parts({"qweight": torch.from_numpy(raw)})
        assert torch.equal(dequantize(parts, Int4(32), (rows, blocks * fmt.block)), ours)


@pytest.mark.parametrize(("name", "at"), [("q8_0", 0), ("q4_k", 0), ("q4_k", 2), ("q5_k", 2), ("q6_k", 208)])
def test_a_damaged_block_scale_is_found(name, at):
    fmt = weight_format(name)
    raw = random_blocks(name, 2, 2, 1)
    assert fmt.check_parts({"qweight": torch.from_numpy(raw)}) is None
    blocks = raw.reshape(2, 2, fmt.block_bytes)
    blocks[1, 1, at : at + 2] = np.array([np.nan], np.float16).view(np.uint8)
    assert "NaN" in fmt.check_parts({"qweight": torch.from_numpy(raw)})


@pytest.mark.skipif(not int4_kernel_ok(), reason="this torch has no CPU int4 kernel")
@pytest.mark.parametrize("pack_rows", [None, 64], ids=["whole", "by-64-rows"])
@pytest.mark.parametrize(("name", "shape"), [("q4_0", (100, 512)), ("q4_0", (70, 96)), ("q4_k", (100, 512)),
                                             ("q4_k", (64, 768)), ("q4_k", (192, 256))])
def test_packed_q4_multiplies_as_its_dequantized_weight(name, shape, pack_rows, monkeypatch):
    """Outputs padded to whole kernel blocks of 64 (100, 70); rows of whole words (the codes combined four bytes at
    a time) and of an odd number of 18-byte q4_0 blocks (byte by byte); repacked whole and 64 outputs at a time
    (`PACK_ROWS`: the last block partly padding)."""
    if pack_rows is not None:
        monkeypatch.setattr("specoffload.runtime.formats.ggml.PACK_ROWS", pack_rows)
    monkeypatch.setattr("specoffload.runtime.formats.ggml.block_kernel", lambda: None)  # (q4_k repacked)
    fmt = weight_format(name)
    raw = torch.from_numpy(random_blocks(name, shape[0], shape[1] // fmt.block, 3))
    assert fmt.stays_packed(shape)
    w = fmt.packed_copy({"qweight": raw}, shape, torch.bfloat16)
    via_int4 = Int4(32).packed_copy(fmt.int4_parts({"qweight": raw}), shape, torch.bfloat16)  # the int4 path
    assert torch.equal(w.codes, via_int4.codes) and torch.equal(w.scales_zeros, via_int4.scales_zeros)
    dense = dequantize({"qweight": raw}, fmt, shape)  # float32
    x = torch.randn(5, shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert rel_err(w.matmul(x), F.linear(x.float(), dense)) < 2e-2  # (scales rounded to bfloat16)
    assert rel_err(w.dequantize(), dense) < 1e-2


@pytest.mark.skipif(not int4_kernel_ok(), reason="this torch has no CPU int4 kernel")
@pytest.mark.parametrize("pack_rows", [None, 64], ids=["whole", "by-64-rows"])
@pytest.mark.parametrize("shape", [(100, 512), (64, 96), (192, 64)])
def test_packed_q8_0_is_int8g_and_multiplies_as_its_dequantized_weight(shape, pack_rows, monkeypatch):
    """q8_0 packs as int8 per group of 32 (the block's d, its codes, -128 included): in float32 the packed weight is
    llama.cpp's decode exactly, and the kernel's product is the product with it; repacked whole and 64 outputs at a
    time (`PACK_ROWS`: the last block partly padding)."""
    if pack_rows is not None:
        monkeypatch.setattr("specoffload.runtime.formats.ggml.PACK_ROWS", pack_rows)
    fmt = weight_format("q8_0")
    raw = torch.from_numpy(random_blocks("q8_0", shape[0], shape[1] // 32, 4))
    raw.view(shape[0], -1, 34)[0, 0, 2] = 0x80  # code -128
    assert fmt.stays_packed(shape)
    dense = dequantize({"qweight": raw}, fmt, shape)  # float32
    w = fmt.packed_copy({"qweight": raw}, shape, torch.float32)
    assert torch.equal(w.dequantize(), dense)
    x = torch.randn(5, shape[1], generator=torch.Generator().manual_seed(0))
    assert rel_err(w.matmul(x), F.linear(x, dense)) < 1e-5
    w16 = fmt.packed_copy({"qweight": raw}, shape, torch.bfloat16)
    assert rel_err(w16.matmul(x.bfloat16()), F.linear(x.bfloat16().float(), dense)) < 2e-2  # (bf16 scales)


@pytest.fixture(scope="module")
def ggufs(tiny_models, tmp_path_factory):
    """name -> (companion dir, reference checkpoint of the decoded weights, the GGUF file)."""
    from scripts.make_tiny_gguf import write_gguf

    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for name in MODELS:
        file = write_gguf(tiny_models[name], root / f"{name}.gguf", root / f"{name}_ref")
        out[name] = (resolve_model(file, root / "companions"), root / f"{name}_ref", file)
    return out


@pytest.mark.parametrize("name", MODELS)
def test_logits_and_greedy_match_transformers(ggufs, name):
    companion, ref, _ = ggufs[name]
    model = Transformer(companion)
    assert model.loader.checkpoint.gguf is not None
    lengths = [7, 3, 12]
    ids, rows = ragged_batch(lengths, seed=0)
    logits = model.forward(ids, model.new_cache(3, capacity=16), num_new=torch.tensor(lengths))
    for b, row in enumerate(rows):
        assert rel_err(logits[b, : len(row)], hf_logits(ref, row)) <= TOL, f"row {b}"
    engine = Engine(EngineConfig(target=companion, max_batch_size=2, dtype="float32"))
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=12))
    assert [r.token_ids for r in out] == hf_greedy(ref, PROMPTS, 12)
    engine.close()


@pytest.mark.parametrize("kv", [{}, {"kv_block_size": 4}], ids=["contiguous", "block-kv"])
@pytest.mark.parametrize("name", MODELS)
def test_offloaded_reads_the_gguf_in_place(ggufs, name, kv):
    companion, _, file = ggufs[name]
    resident, engine = offload_greedy(EngineConfig(target=companion, max_batch_size=3, dtype="float32"))
    engine.close()
    out, engine = offload_greedy(tight_config(companion, dtype="float32", **kv))
    assert engine.placement.streamed_layers and engine.last_stats.bytes_read > 0
    assert out == resident
    engine.close()


@pytest.mark.parametrize("drafter", [{"drafter": "lowbit"}, {"draft": "self"}], ids=["lowbit", "self"])
def test_speculation_on_a_gguf_target_is_lossless(ggufs, drafter):
    companion = ggufs["qwen3_moe_256"][0]
    plain, engine = offload_greedy(tight_config(companion, dtype="float32", num_draft_tokens=0))
    engine.close()
    out, engine = offload_greedy(tight_config(companion, dtype="float32", **drafter))
    assert engine.last_stats.num_drafted > 0
    assert out == plain
    engine.close()


@pytest.mark.skipif(not int4_kernel_ok(), reason="this torch has no CPU int4 kernel")
@pytest.mark.parametrize("ggml_kernel", [True, False], ids=["ggml-kernel", "int4-kernel"])
def test_bfloat16_streams_q4_blocks_packed(ggufs, ggml_kernel, monkeypatch):
    """In bfloat16 the q4_0 / q4_k / q8_0 weights a slot streams stay packed for the int4 kernel, or q4_k / q6_k as
    their blocks for the ggml kernel where it is built (runtime/kernels; the others are decoded into the slot); the
    run's tokens are the float32 run's on most positions (the kernel's bfloat16 scales, the rounded products)."""
    from specoffload.runtime.formats.ggml import block_kernel as built

    if not ggml_kernel:
        monkeypatch.setattr("specoffload.runtime.formats.ggml.block_kernel", lambda: None)
    elif built() is None:
        pytest.skip("no C compiler: the ggml kernel is not built here")
    companion = ggufs["qwen2_256"][0]
    reference, engine = offload_greedy(tight_config(companion, dtype="float32"))
    engine.close()
    out, engine = offload_greedy(tight_config(companion, dtype="bfloat16", packed_weights="slots"))
    streamer = engine.workers.prefetch.streamer
    keys = [k for k in engine.workers.prefetch.model.loader.parts() if engine.placement.is_streamed(k)]
    fields = [f for key in keys for f in streamer.layout(key).fields]
    kinds = {f.quant.spec.name for f in fields if f.packed}
    packable = {"q4_0", "q4_k", "q8_0"} | ({"q6_k"} if ggml_kernel else set())
    assert kinds and kinds <= packable and ("q6_k" in kinds) == ggml_kernel
    assert {f.quant.spec.name for f in fields if f.quant is not None and not f.packed} - packable
    same = sum(a == b for x, y in zip(out, reference) for a, b in zip(x, y))
    assert same >= 0.7 * sum(map(len, reference))
    engine.close()


def test_a_gguf_target_kept_as_blocks_gives_transformers_tokens(ggufs):
    """float32, weights kept as blocks ("on"): the q4_k / q6_k / f16 matrices multiply in the kernel, resident and
    streamed at the smallest budget (their bytes read straight into the slot); greedy tokens are transformers' on the
    decoded weights."""
    from specoffload.runtime import kernels
    from specoffload.runtime.formats.ggml import block_kernel
    from specoffload.runtime.models.packed import PackedBlocks

    if block_kernel() is None:
        pytest.skip("no C compiler: the ggml kernel is not built here")
    companion, ref, _ = ggufs["qwen2_moe_256"]
    want = hf_greedy(ref, OFFLOAD_PROMPTS, 10)
    resident, engine = offload_greedy(tight_config(companion, dtype="float32", packed_weights="on",
                                                   device_memory="1GiB", num_buffers=2))
    engine.close()
    assert resident == want
    out, engine = offload_greedy(tight_config(companion, dtype="float32", packed_weights="on"))
    streamer = engine.workers.prefetch.streamer
    keys = [k for k in engine.workers.prefetch.model.loader.parts() if engine.placement.is_streamed(k)]
    fields = [f for key in keys for f in streamer.layout(key).fields]
    assert {f.quant.spec.name for f in fields if f.packed} >= set(kernels.KINDS)
    assert all(f.packed for f in fields if f.quant is not None and f.quant.spec.name in kernels.KINDS)
    views = [v for key in keys for v in streamer._views(streamer._slots[0], key, 0).values()]
    assert any(isinstance(v, PackedBlocks) for v in views)
    assert out == want
    engine.close()


def test_embedding_rows_decode_blocks(ggufs):
    companion = ggufs["qwen2_256"][0]
    ckpt = Checkpoint(companion)
    name = "model.embed_tokens.weight"
    assert ckpt.quantized(name) is not None  # Q4_K in the tiny GGUF
    rows = EmbeddingRows(ckpt, name, torch.float32)
    ids = torch.tensor([[5, 300, 5], [511, 0, 7]])
    assert torch.equal(rows(ids), ckpt.get(name, torch.float32)[ids])
    rows.close()


def test_a_gguf_path_resolves_to_its_companion(ggufs, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECOFFLOAD_GGUF_CACHE", str(tmp_path / "cache"))
    _, _, file = ggufs["qwen2_256"]
    config = EngineConfig(target=str(file))
    assert (Path(config.target) / GGUF_POINTER).is_file() and Path(config.target).parent == tmp_path / "cache"
    holder = tmp_path / "holder"
    holder.mkdir()
    shutil.copy(file, holder / file.name)
    assert gguf_file_in(holder) == holder / file.name
    shutil.copy(file, holder / "second.gguf")
    with pytest.raises(CheckpointError, match="2 GGUF files"):
        gguf_file_in(holder)
    assert checkpoint_identity(config.target).startswith("gguf-sha256:")
    assert gguf_file_in(config.target) is None  # a companion is a checkpoint directory
    with pytest.raises(CheckpointError, match="not found"):
        EngineConfig(target=str(tmp_path / "missing.gguf"))


def test_a_companion_of_an_older_reader_is_made_again(ggufs, tmp_path, monkeypatch):
    """The companion directory's name covers the tensor table's version: a table an older reader wrote (one whose
    shapes may differ) is not reused, a new companion is made beside it."""
    import specoffload.runtime.models.gguf as gguf_module

    _, _, file = ggufs["qwen2_moe_256"]
    monkeypatch.setattr(gguf_module, "POINTER_VERSION", gguf_module.POINTER_VERSION - 1)
    old = resolve_model(file, tmp_path)
    monkeypatch.undo()
    new = resolve_model(file, tmp_path)
    assert new != old and (old / GGUF_POINTER).is_file() and (new / GGUF_POINTER).is_file()
    assert Checkpoint(new).gguf is not None


def _write(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, str]]) -> Path:
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name, (data, kind) in tensors.items():
        if kind == "F32":
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unreadable_ggufs_fail_in_one_line(ggufs, tmp_path):
    w = np.zeros((4, 256), np.float32)
    with pytest.raises(UnsupportedModelError, match="architecture 'gemma3'.*supported: llama, qwen2"):
        resolve_model(_write(tmp_path / "l.gguf", "gemma3", {"token_embd.weight": (w, "F32")}), tmp_path)
    q2 = np.zeros((4, GGML_QUANT_SIZES[GGMLQuantizationType.Q2_K][1]), np.uint8)
    with pytest.raises(UnsupportedModelError, match="up_proj.weight. is Q2_K"):
        resolve_model(_write(tmp_path / "q2.gguf", "qwen2", {"blk.0.ffn_up.weight": (q2, "Q2_K")}), tmp_path)
    with pytest.raises(UnsupportedModelError, match="no counterpart"):
        resolve_model(_write(tmp_path / "x.gguf", "qwen2", {"blk.0.mystery.weight": (w, "F32")}), tmp_path)
    good = ggufs["qwen2_256"][2]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="cut.gguf"):
        resolve_model(cut, tmp_path)


def test_quantize_refuses_a_gguf(ggufs, tmp_path, capsys):
    assert cli_main(["quantize", "--model", str(ggufs["qwen2_256"][0]), "--to", "int4", "--out",
                     str(tmp_path / "q")]) == 2
    assert "GGUF file: it runs as stored" in capsys.readouterr().err
