"""A checkpoint is checked against its config before anything is allocated, its headers are parsed with bounds, and
every error is one CheckpointError naming the file (and tensor) (issue 25, items 4-5)."""

from __future__ import annotations

import json
import resource
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from specoffload.runtime.models.checkpoint import Checkpoint
from specoffload.runtime.models.errors import CheckpointError
from specoffload.runtime.models.model import Transformer

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture
def llama_copy(tiny_models: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_models["llama"], tmp_path / "llama"))


def _edit_config(path: Path, **changes: object) -> None:
    file = path / "config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | changes))


def test_a_tensor_off_the_config_by_one_is_named_with_file_and_shapes(llama_copy: Path) -> None:
    intermediate = json.loads((llama_copy / "config.json").read_text())["intermediate_size"]
    _edit_config(llama_copy, intermediate_size=intermediate + 1)
    with pytest.raises(CheckpointError) as info:
        Transformer(llama_copy)
    message = str(info.value)
    assert "model.layers.0.mlp.gate_proj.weight" in message and str(llama_copy / "model.safetensors") in message
    assert f"expected shape [{intermediate + 1}, 64]" in message and f"found [{intermediate}, 64]" in message
    assert "\n" not in message


def test_an_int_tensor_in_a_float_model_is_refused(llama_copy: Path) -> None:
    file = llama_copy / "model.safetensors"
    tensors = load_file(file)
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model.layers.1.self_attn.k_proj.weight' in .*model.safetensors: "
                                              r"expected a float dtype .* found I32"):
        Transformer(llama_copy)


def test_a_config_implying_more_than_the_files_hold_is_refused_before_allocating(llama_copy: Path) -> None:
    _edit_config(llama_copy, hidden_size=10**9, head_dim=16)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CheckpointError, match=r"config.json implies at least \d+ bytes of weights .*hold \d+ bytes"):
        Transformer(llama_copy)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024  # KiB: nothing allocated


def test_a_deeply_nested_header_is_one_line_naming_the_file(tmp_path: Path) -> None:
    raw = b"[" * 100_000 + b"]" * 100_000
    file = tmp_path / "ckpt" / "model.safetensors"
    file.parent.mkdir()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CheckpointError, match="nested more than") as info:
        Checkpoint(file.parent)
    assert str(file) in str(info.value)


def test_a_streaming_error_names_the_tensor_and_the_file(llama_copy: Path) -> None:
    from specoffload.runtime.offload.streamer import Piece, _naming

    piece = Piece(str(llama_copy / "model.safetensors"), 0, 4, torch.float32, torch.empty(1), "model.norm.weight")
    match = r"streaming tensor 'model.norm.weight' from .*model.safetensors: boom"
    with pytest.raises(CheckpointError, match=match), _naming([piece]):
        raise OSError("boom")


# ---- property tests: the header reader never raises anything but CheckpointError ------------------------------------
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)
_entries = st.fixed_dictionaries({"dtype": st.sampled_from(["F32", "F16", "I8", "BOOL", "XX", 3]),
                                  "shape": st.lists(st.integers(-2, 2**40), max_size=3) | _json_values,
                                  "data_offsets": st.lists(st.integers(-16, 2**64), max_size=3) | _json_values})
_headers = st.dictionaries(st.text(max_size=8), _entries | _json_values, max_size=4) | _json_values


def _header_file(tmp: Path, raw: bytes, declared: int | None, tail: bytes) -> Path:
    d = tmp / "ckpt"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw) if declared is None else declared) + raw + tail)
    return d


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=_headers, declared=st.none() | st.integers(0, 2**64 - 1), tail=st.binary(max_size=64))
def test_random_headers_open_or_raise_checkpoint_error(tmp_path: Path, header: object, declared: int | None,
                                                       tail: bytes) -> None:
    d = _header_file(tmp_path, json.dumps(header).encode(), declared, tail)
    try:
        Checkpoint(d)
    except CheckpointError as err:
        assert str(d / "model.safetensors") in str(err) and "\n" not in str(err)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=256) | st.builds(lambda n, c: c * n, st.integers(0, 50_000),
                                               st.sampled_from([b"[", b"{", b'{"a":', b"9", b'"', b"\\"])))
def test_adversarial_header_bytes_raise_only_checkpoint_error(tmp_path: Path, raw: bytes) -> None:
    d = _header_file(tmp_path, raw, None, b"")
    try:
        Checkpoint(d)
    except CheckpointError as err:
        assert str(d / "model.safetensors") in str(err)
