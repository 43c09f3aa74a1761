"""The minor cases of issue 39 (case 8): tensors a config does not describe are refused in one line; `quantize`
names a non-finite tensor and leaves no partial directory; an edited quantization.json is refused; a UTF-8
byte-order mark before the first row is no error.
"""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.formats import weight_format
from specoffload.runtime.models.checkpoint import Checkpoint
from specoffload.runtime.models.errors import CheckpointError
from specoffload.runtime.offline.rows import RowRequest
from specoffload.runtime.offline.simple import SimpleFormat
from specoffload.runtime.offline.source import InputSource
from specoffload.runtime.quantize import quantize_checkpoint


def test_a_config_with_fewer_layers_than_the_checkpoint_is_refused(tiny_models, tmp_path) -> None:
    path = tmp_path / "llama"
    shutil.copytree(tiny_models["llama"], path)
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.1\..*' in .*model.safetensors \(and \d+ "
                                              r"more\) is not part of the model .* \(1 layers") as err:
        Engine(EngineConfig(path))
    assert "\n" not in str(err.value)


def test_quantize_names_a_non_finite_tensor_and_leaves_no_partial_directory(tiny_models, tmp_path) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny_models["llama"], src)
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name][3, 5] = float("inf")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=f"cannot compress {name}: .*non-finite"):
        quantize_checkpoint(src, out, weight_format("int8"))
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_an_edited_quantization_manifest_is_refused(tiny_models, tmp_path) -> None:
    out = tmp_path / "q"
    quantize_checkpoint(tiny_models["llama"], out, weight_format("int8"))
    manifest = json.loads((out / "quantization.json").read_text())
    first = next(iter(manifest["tensors"].values()))
    first["dtype"] = "BF16" if first["dtype"] != "BF16" else "F16"
    (out / "quantization.json").write_text(json.dumps(manifest, indent=1) + "\n")
    with pytest.raises(CheckpointError, match="quantization.json does not match the SHA-256"):
        Checkpoint(out)


def test_a_byte_order_mark_before_the_first_row_is_accepted(tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"token_ids": [1, 5]}).encode() + b"\n"
                     + json.dumps({"prompt": "x"}).encode() + b"\n")
    rows = [SimpleFormat().parse(raw) for raw in InputSource.file(path).rows()]
    assert all(isinstance(r, RowRequest) for r in rows) and rows[0].prompt == (1, 5)
    text = tmp_path / "p.txt"
    text.write_bytes("\ufeffhello\nworld\n".encode())
    rows = [SimpleFormat(text=True).parse(raw) for raw in InputSource.file(text).rows()]
    assert [r.prompt for r in rows] == ["hello", "world"]
