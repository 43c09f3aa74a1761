"""Bad checkpoints fail early with the right SpecOffloadError subclass and a message naming the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specoffload.runtime.models.checkpoint import Checkpoint
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
    model = Transformer(llama_copy)  # lazy: nothing is read yet
    with pytest.raises(CheckpointError, match="'lm_head.weight' not found") as info:
        model.forward(torch.tensor([[1, 2]]), model.new_cache(1, 4))
    assert str(llama_copy) in str(info.value)
