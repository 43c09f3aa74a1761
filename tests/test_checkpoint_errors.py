"""Bad checkpoints fail early with the right SpecOffloadError subclass and a message naming the problem."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specoffload.runtime.models.checkpoint import MAX_HEADER_BYTES, Checkpoint
from specoffload.runtime.models.config import ModelConfig
from specoffload.runtime.models.errors import CheckpointError, SpecOffloadError, UnsupportedModelError
from specoffload.runtime.models.model import Transformer

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture
def llama_copy(tiny_models: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_models["llama"], tmp_path / "llama"))


def edit_config(path: Path, **changes: object) -> None:
    file = path / "config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | changes))


def test_errors_are_user_facing() -> None:
    assert issubclass(CheckpointError, SpecOffloadError) and issubclass(UnsupportedModelError, SpecOffloadError)


def test_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    for open_it in (Checkpoint, ModelConfig.from_dir, Transformer):
        with pytest.raises(CheckpointError, match="directory not found") as info:
            open_it(missing)
        assert str(missing) in str(info.value)


def test_no_safetensors_files(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no safetensors files") as info:
        Transformer(llama_copy)
    assert str(llama_copy) in str(info.value)


def test_missing_shard(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    path = Path(shutil.copytree(tiny_models["llama_sharded"], tmp_path / "sharded"))
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"shard {victim.name} .* is missing"):
        Checkpoint(path)


@pytest.mark.parametrize("keep_bytes", [5, 100, -200])
def test_truncated_safetensors(llama_copy: Path, keep_bytes: int) -> None:
    file = llama_copy / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:keep_bytes])
    with pytest.raises(CheckpointError, match="truncated") as info:
        Checkpoint(llama_copy)
    assert str(file) in str(info.value)


def test_garbage_safetensors_header(llama_copy: Path) -> None:
    file = llama_copy / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:40] = b"\xff" * 32  # the JSON header starts at byte 8
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt safetensors header") as info:
        Checkpoint(llama_copy)
    assert str(file) in str(info.value)


def test_corrupt_or_missing_config(llama_copy: Path) -> None:
    config = llama_copy / "config.json"
    config.write_text('{"architectures": ["LlamaForCausalLM"], ')
    with pytest.raises(CheckpointError, match="corrupt") as info:
        Transformer(llama_copy)
    assert str(config) in str(info.value)
    config.unlink()
    with pytest.raises(CheckpointError, match="missing config.json"):
        ModelConfig.from_dir(llama_copy)


def test_unsupported_architecture(llama_copy: Path) -> None:
    edit_config(llama_copy, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError) as info:
        Transformer(llama_copy)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert all(name in message for name in ("LlamaForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM"))


def test_length_dependent_rope_is_unsupported(llama_copy: Path) -> None:
    edit_config(llama_copy, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        ModelConfig.from_dir(llama_copy)


def test_missing_tensor_is_named(llama_copy: Path) -> None:
    file = llama_copy / "model.safetensors"
    tensors = load_file(file)
    del tensors["lm_head.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="'lm_head.weight' that .*config.json implies is missing") as info:
        Transformer(llama_copy)  # refused at open (runtime/models/validate.py), nothing read but headers
    assert str(llama_copy) in str(info.value)


def write_safetensors(directory: Path, header: object, data: bytes = bytes(64)) -> Path:
    """A single-file checkpoint with a hand-written header (the 8-byte length, the JSON, then `data`)."""
    directory.mkdir(exist_ok=True)
    raw = json.dumps(header).encode()
    file = directory / "model.safetensors"
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return file


F32x2 = {"dtype": "F32", "shape": [2]}  # 8 bytes of data
EMPTY = {"dtype": "F32", "shape": [0]}


@pytest.mark.parametrize(
    ("header", "match"),
    [
        pytest.param({"a": F32x2 | {"data_offsets": [-8, 0]}}, "negative", id="negative-offset"),
        pytest.param({"a": F32x2 | {"data_offsets": [8, 0]}}, "reversed", id="reversed-offsets"),
        pytest.param({"a": F32x2 | {"data_offsets": [0, 8]}, "b": F32x2 | {"data_offsets": [4, 12]}}, "overlap",
                     id="overlapping"),
        pytest.param({"a": F32x2 | {"data_offsets": [0, 8]}, "b": EMPTY | {"data_offsets": [4, 4]}}, "overlap",
                     id="empty-inside-another"),
        pytest.param({"a": {"dtype": "XX", "shape": [2], "data_offsets": [0, 8]}}, "dtype 'XX'", id="unknown-dtype"),
        pytest.param({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, "shape", id="float-dim"),
        pytest.param({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, "shape", id="negative-dim"),
        pytest.param({"a": F32x2 | {"data_offsets": [0, 8, 16]}}, "two integers", id="three-offsets"),
        pytest.param({"a": F32x2 | {"data_offsets": [0, 4]}}, "needs 8", id="wrong-size"),
        pytest.param({"a": F32x2 | {"data_offsets": [100, 108]}}, "truncated", id="past-the-end"),
        pytest.param({"a": "F32"}, "no entry object", id="entry-not-an-object"),
        pytest.param(["a"], "not a JSON object", id="header-not-an-object"),
    ],
)
def test_every_header_entry_is_validated_at_open(tmp_path: Path, header: object, match: str) -> None:
    """Offsets reach `file_of`, whose byte ranges are read directly (bypassing safetensors): a negative offset
    used to stream header bytes as weights."""
    file = write_safetensors(tmp_path / "ckpt", header)
    with pytest.raises(CheckpointError, match=match) as info:
        Checkpoint(tmp_path / "ckpt")
    assert str(file) in str(info.value)


def test_a_valid_hand_written_header_opens(tmp_path: Path) -> None:
    data = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    header = {"__metadata__": {"format": "pt"}, "a": F32x2 | {"data_offsets": [0, 8]},
              "b": F32x2 | {"data_offsets": [8, 16]}, "e": EMPTY | {"data_offsets": [16, 16]}}
    write_safetensors(tmp_path / "ckpt", header, data)
    ckpt = Checkpoint(tmp_path / "ckpt")
    assert ckpt.get("b").tolist() == [2.0, 3.0] and ckpt.file_of("b").length == 8


def test_a_huge_header_length_is_refused_before_reading(tmp_path: Path) -> None:
    """Bounded by the file size alone, a corrupt length made Checkpoint read (and parse) gigabytes."""
    file = tmp_path / "ckpt" / "model.safetensors"
    file.parent.mkdir()
    with file.open("wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        f.truncate(MAX_HEADER_BYTES + 64)  # sparse: no disk used
    with pytest.raises(CheckpointError, match=f"over the {MAX_HEADER_BYTES}-byte limit"):
        Checkpoint(tmp_path / "ckpt")
