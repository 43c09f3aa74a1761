"""WeightStreamer and DirectReader: streamed parts equal the loader's, reads are coalesced, bad files fail cleanly."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from specoffload.runtime.models.checkpoint import Checkpoint
from specoffload.runtime.models.config import ModelConfig
from specoffload.runtime.models.errors import CheckpointError
from specoffload.runtime.models.weights import PartKey, WeightLoader
from specoffload.runtime.offload.direct_io import ALIGN, BUFFERED, DIRECT, AlignedBuffer, DirectReader
from specoffload.runtime.offload.streamer import Piece, WeightStreamer, coalesce

SLOT = 1 << 20  # bytes: more than any part of the tiny models in float32


def _loader(path: Path, dtype: torch.dtype = torch.float32) -> WeightLoader:
    return WeightLoader(Checkpoint(path), ModelConfig.from_dir(path), dtype, "cpu")


def _fields(weights: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted field name, tensor or None) for every leaf of a Weights dataclass, nested ExpertWeights included."""
    for f in dataclasses.fields(weights):
        value = getattr(weights, f.name)
        if dataclasses.is_dataclass(value):
            yield from _fields(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def _assert_same_parts(streamer: WeightStreamer, loader: WeightLoader, keys: list[PartKey]) -> None:
    """Load each part alternately into slots 0 and 1; compare with `loader.load` exactly, field by field."""
    for i, key in enumerate(keys):
        slot = streamer._slots[i % 2]
        got, want = streamer.load(i % 2, [key])[key], loader.load(key)
        assert type(got) is type(want), key
        got_fields, want_fields = dict(_fields(got)), dict(_fields(want))
        assert got_fields.keys() == want_fields.keys()
        for name, expected in want_fields.items():
            actual = got_fields[name]
            if expected is None:
                assert actual is None, (key, name)
                continue
            assert actual.dtype == loader.dtype and actual.shape == expected.shape, (key, name)
            assert torch.equal(actual, expected), (key, name)
            begin = actual.data_ptr() - slot.data_ptr()  # a view into the slot, not a copy
            assert begin >= 0 and begin + actual.nbytes <= slot.nbytes, (key, name)


def _copy_as(src: Path, dst: Path, dtype: torch.dtype) -> Path:
    """A copy of checkpoint `src` with every tensor stored in `dtype`."""
    dst.mkdir()
    for file in src.iterdir():
        if file.suffix == ".safetensors":
            save_file({k: v.to(dtype) for k, v in load_file(file).items()}, dst / file.name, {"format": "pt"})
        else:
            shutil.copy(file, dst / file.name)
    return dst


# --- streamed parts equal loaded parts ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("source", ["disk", "ram"])
@pytest.mark.parametrize("model", ["llama", "mixtral", "mixtral_fused", "qwen2_moe"])
def test_streamed_parts_equal_loaded_parts(
    tiny_models: dict[str, Path], model: str, source: str, dtype: torch.dtype, single_thread: None
) -> None:
    loader = _loader(tiny_models[model], dtype)
    keys = loader.parts()
    with WeightStreamer(loader, SLOT, 2, source, "cpu", parts=keys) as streamer:
        _assert_same_parts(streamer, loader, keys)
        assert streamer.bytes_read > 0


@pytest.mark.parametrize("file_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_16_bit_files_convert_like_the_loader(
    tiny_models: dict[str, Path], tmp_path: Path, file_dtype: torch.dtype, dtype: torch.dtype
) -> None:
    path = _copy_as(tiny_models["mixtral_fused"], tmp_path / "half", file_dtype)
    loader = _loader(path, dtype)
    key = PartKey("expert", 1, 2)
    assert loader.checkpoint.torch_dtype(loader.refs(key)["gate_up"].name) == file_dtype
    for source in ("disk", "ram"):
        with WeightStreamer(loader, SLOT, 2, source, "cpu", parts=loader.parts()) as streamer:
            _assert_same_parts(streamer, loader, loader.parts())


def test_tensors_larger_than_the_staging_buffer_are_read_in_pieces(tiny_models: dict[str, Path]) -> None:
    loader = _loader(tiny_models["llama"])
    embed = loader.checkpoint.nbytes("model.embed_tokens.weight")
    staging = 4 * ALIGN
    assert embed > 4 * staging
    with WeightStreamer(loader, SLOT, 2, "disk", "cpu", staging_bytes=staging) as streamer:
        _assert_same_parts(streamer, loader, loader.parts())
        assert streamer.reader.reads >= embed // staging


def test_layout_and_errors_for_slots(tiny_models: dict[str, Path]) -> None:
    loader = _loader(tiny_models["qwen2_moe"])
    router, expert = PartKey("router", 0), PartKey("expert", 0, 1)
    with WeightStreamer(loader, SLOT, 2, "ram", "cpu", parts=[router]) as streamer:
        need = streamer.nbytes([router, expert])
        assert loader.nbytes(router) + loader.nbytes(expert) <= need
        assert need <= loader.nbytes(router) + loader.nbytes(expert) + 64 * 10  # 10 tensors, 64-byte alignment
        assert streamer.nbytes([router, router]) == streamer.nbytes([router])
        with pytest.raises(ValueError, match="host RAM tier"):
            streamer.load(0, [expert])
        with pytest.raises(IndexError):
            streamer.load(2, [router])
    small = streamer.nbytes([router, expert]) - 1
    with WeightStreamer(loader, small, 1, "disk", "cpu") as streamer:
        with pytest.raises(ValueError, match="slot holds"):
            streamer.load(0, [router, expert])
        assert streamer.bytes_read == 0
        assert streamer.load(0, [router])[router].gate.shape == (4, 64)
    with pytest.raises(ValueError, match="parts"):
        WeightStreamer(loader, SLOT, 1, "ram", "cpu")


# --- reads: coalescing, bytes, tracing ---------------------------------------------------------------------


def test_a_layer_is_read_with_fewer_reads_than_tensors(tiny_models: dict[str, Path]) -> None:
    loader = _loader(tiny_models["mixtral"])
    layer = [PartKey("attention", 1), PartKey("router", 1), *(PartKey("expert", 1, e) for e in range(4))]
    tensors = sum(len(loader.refs(key)) for key in layer)
    with WeightStreamer(loader, SLOT, 1, "disk", "cpu") as streamer:
        streamer.load(0, layer)
        assert 1 <= streamer.reader.reads < tensors
    with WeightStreamer(loader, SLOT, 1, "disk", "cpu", max_gap=0) as exact:
        exact.load(0, layer)
        assert exact.reader.reads <= streamer.reader.reads * 4  # still merges adjacent tensors


@pytest.mark.parametrize("direct", [True, False])
def test_bytes_read_is_the_tensor_bytes_plus_alignment(tiny_models: dict[str, Path], direct: bool) -> None:
    loader = _loader(tiny_models["qwen2_moe"])
    ckpt = loader.checkpoint
    with WeightStreamer(loader, SLOT, 2, "disk", "cpu", direct=direct, max_gap=0) as streamer:
        total = 0
        for i, key in enumerate(loader.parts()):
            streamer.load(i % 2, [key])
            total += sum(ckpt.nbytes(ref.name, ref.index) for ref in loader.refs(key).values())
        assert total <= streamer.bytes_read <= total + 2 * ALIGN * streamer.reader.reads
        assert streamer.reader.mode == (DIRECT if direct else BUFFERED)
    parts = loader.parts()
    with WeightStreamer(loader, SLOT, 2, "ram", "cpu", parts=parts) as ram:
        assert ram.bytes_read == 0  # the preload is not counted
        ram.load(0, parts[:2])
        assert ram.bytes_read == ram.nbytes(parts[:2])


def test_tracer_gets_load_read_and_copy_spans(tiny_models: dict[str, Path]) -> None:
    class FakeTracer:
        def __init__(self) -> None:
            self.spans: list[tuple[str, str, dict[str, Any]]] = []

        def span(self, name: str, resource: str, **args: Any) -> contextlib.AbstractContextManager[None]:
            self.spans.append((name, resource, args))
            return contextlib.nullcontext()

    tracer = FakeTracer()
    loader = _loader(tiny_models["llama"])
    with WeightStreamer(loader, SLOT, 2, "disk", "cpu", tracer=tracer) as streamer:
        streamer.load(1, [PartKey("attention", 0)])
    names = [(name, resource) for name, resource, _ in tracer.spans]
    assert names[0] == ("load", "io") and tracer.spans[0][2]["slot"] == 1
    assert ("read", "disk") in names and ("copy", "copy") in names


def test_coalesce_on_literal_pieces() -> None:
    def piece(path: str, offset: int, length: int) -> Piece:
        return Piece(path, offset, length, torch.uint8, torch.empty(length, dtype=torch.uint8))

    a = piece("f", 0, 100)
    b = piece("f", 100, 50)  # adjacent to a
    c = piece("f", 1000, 10)  # 850-byte gap after b
    d = piece("g", 150, 10)  # another file
    e = piece("f", 20_000, 100)  # far away
    groups = coalesce([e, d, c, b, a], max_span=4 * ALIGN, max_gap=1000)
    assert [[(p.path, p.offset) for p in g] for g in groups] == [
        [("f", 0), ("f", 100), ("f", 1000)],
        [("f", 20_000)],
        [("g", 150)],
    ]
    assert len(coalesce([a, b, c], max_span=4 * ALIGN, max_gap=0)) == 2
    far = piece("f", 2 * ALIGN, 10)
    assert len(coalesce([a, far], max_span=2 * ALIGN, max_gap=1 << 20)) == 2  # span 3 * ALIGN: too large


# --- DirectReader ------------------------------------------------------------------------------------------


def _data_file(tmp_path: Path, n: int = 5 * ALIGN + 123) -> tuple[Path, bytes]:
    data = bytes((i * 7 + i // 251) % 256 for i in range(n))
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("direct", [True, False])
def test_direct_reader_returns_exact_unaligned_ranges(tmp_path: Path, direct: bool) -> None:
    path, data = _data_file(tmp_path)
    buf = AlignedBuffer(8 * ALIGN)
    assert buf.tensor.data_ptr() % ALIGN == 0 and buf.nbytes == len(buf.memoryview) == 8 * ALIGN
    with DirectReader(direct=direct, max_chunk=ALIGN) as reader:  # one-page chunks: many preadv calls
        for offset, length in [(0, 10), (1, ALIGN), (ALIGN - 3, 2 * ALIGN + 7), (len(data) - 50, 50), (7, 0)]:
            got = reader.read_into(str(path), offset, length, buf, buf_offset=ALIGN)
            assert bytes(got.numpy()) == data[offset : offset + length], (offset, length)
        assert reader.reads == 5
        assert reader.bytes_read >= 10 + ALIGN + 2 * ALIGN + 7 + 50
    if direct and reader.mode != DIRECT:
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    assert reader.mode == (DIRECT if direct else BUFFERED)


@pytest.mark.parametrize("where", ["open", "read"])
def test_direct_reader_falls_back_when_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Fake a filesystem that refuses O_DIRECT with EINVAL (tmpfs on older kernels) at open or at read."""
    real_open, real_preadv = os.open, os.preadv

    def refusing_open(path: str, flags: int, *args: Any) -> int:
        if where == "open" and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def refusing_preadv(fd: int, buffers: Any, offset: int) -> int:
        if where == "read" and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(os, "preadv", refusing_preadv)
    path, data = _data_file(tmp_path)
    with DirectReader(direct=True) as reader:
        assert reader.mode == DIRECT
        got = reader.read_into(str(path), 100, 3000, AlignedBuffer(2 * ALIGN))
        assert bytes(got.numpy()) == data[100:3100]
        assert reader.mode == BUFFERED


def test_direct_reader_rejects_bad_arguments(tmp_path: Path) -> None:
    path, _ = _data_file(tmp_path)
    with DirectReader() as reader:
        with pytest.raises(ValueError, match="needs"):
            reader.read_into(str(path), 10, ALIGN, AlignedBuffer(ALIGN))  # spans two pages
        with pytest.raises(ValueError, match="multiple"):
            reader.read_into(str(path), 0, 10, AlignedBuffer(2 * ALIGN), buf_offset=100)
    with pytest.raises(ValueError):
        AlignedBuffer(0)


def test_reads_run_ahead_on_one_thread_in_file_order(tiny_models: dict[str, Path]) -> None:
    """On the CPU the next group's read (the reader thread) overlaps this group's conversion (the caller's): every
    read is on the one reader thread, in file order, and the slot holds what the loader loads."""
    import threading

    loader = _loader(tiny_models["qwen3_moe"])
    with WeightStreamer(loader, SLOT, 2, "disk", "cpu", staging_bytes=4 * ALIGN) as streamer:
        calls: list[tuple[str, int]] = []
        read_into = streamer.reader.read_into

        def recording(path, offset, *args):  # noqa: ANN001, ANN202
            calls.append((threading.current_thread().name, offset))
            return read_into(path, offset, *args)

        streamer.reader.read_into = recording
        keys = [key for key in loader.parts() if key.kind == "expert" and key.layer == 0]
        got = streamer.load(0, keys)
        for key in keys:
            for (name, actual), (_, expected) in zip(_fields(got[key]), _fields(loader.load(key)), strict=True):
                assert (actual is None and expected is None) or torch.equal(actual, expected), (key, name)
        assert len(calls) > 2
        assert {name.split("_")[0] for name, _ in calls} == {"specoffload-read"}
        assert [offset for _, offset in calls] == sorted(offset for _, offset in calls)


# --- files that change under the streamer ------------------------------------------------------------------


def test_truncated_file_mid_stream_raises_checkpoint_error(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    path = Path(shutil.copytree(tiny_models["llama"], tmp_path / "llama"))
    loader = _loader(path)
    file = path / "model.safetensors"
    half = file.stat().st_size // 2
    ends = {key: max(loc.offset + loc.length for loc in _locations(loader, key)) for key in loader.parts()}
    before = [key for key in loader.parts() if ends[key] <= half]
    after = [key for key in loader.parts() if min(loc.offset for loc in _locations(loader, key)) > half]
    assert before and after
    with WeightStreamer(loader, SLOT, 2, "disk", "cpu") as streamer:
        streamer.load(0, before[:1])  # the file is open now
        os.truncate(file, half)
        with pytest.raises(CheckpointError, match="model.safetensors") as info:
            streamer.load(1, after[-1:])
        assert "truncated" in str(info.value) and "expected" in str(info.value)


def test_file_deleted_before_its_first_read_raises_checkpoint_error(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    path = Path(shutil.copytree(tiny_models["llama_sharded"], tmp_path / "sharded"))
    loader = _loader(path)
    key = PartKey("attention", 1)
    shard = Path(next(iter(_locations(loader, key))).path)
    with WeightStreamer(loader, SLOT, 1, "disk", "cpu") as streamer:
        shard.unlink()
        with pytest.raises(CheckpointError, match=shard.name):
            streamer.load(0, [key])


def _locations(loader: WeightLoader, key: PartKey) -> list[Any]:
    return [loader.checkpoint.file_of(ref.name, ref.index) for ref in loader.refs(key).values()]


def test_checkpoint_shape_of_and_torch_dtype(tiny_models: dict[str, Path]) -> None:
    ckpt = Checkpoint(tiny_models["mixtral_fused"])
    name = "model.layers.0.mlp.experts.gate_up_proj"
    experts, *row = ckpt.shape(name)
    assert experts == 4 and ckpt.shape_of(name) == (4, *row) and ckpt.shape_of(name, 3) == tuple(row)
    assert ckpt.torch_dtype(name) == torch.float32
    with pytest.raises(IndexError):
        ckpt.shape_of(name, 4)
    with pytest.raises(CheckpointError, match="not found"):
        ckpt.torch_dtype("no.such.tensor")
