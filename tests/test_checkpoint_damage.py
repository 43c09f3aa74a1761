"""Damaged compressed tensors and swapped checkpoint files (issue 39, case 5): one line naming tensor and file, never
all-zero tokens or a crash mid-run.

Scales and zero points are checked when a compressed checkpoint opens (finite, >= 0, weights within float16's
range); codes where they are first read (the resident loader, the streamer). A file whose SHA-256 differs from the
one its provenance.json records is refused when the checkpoint opens, and so on `--resume`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specoffload.runtime import hashing
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.formats import weight_format
from specoffload.runtime.models.checkpoint import Checkpoint
from specoffload.runtime.models.errors import CheckpointError
from specoffload.runtime.offload.executor import PipelineError
from specoffload.runtime.quantize import quantize_checkpoint
from specoffload.runtime.sampling import SamplingParams

NAME = "model.layers.1.mlp.down_proj.weight"
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def compressed(tiny_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compressed")
    out = {}
    for scheme, spec in (("int8", weight_format("int8")), ("int4", weight_format("int4", 32))):
        out[scheme] = root / scheme
        quantize_checkpoint(tiny_models["llama"], out[scheme], spec)
    return out


def _damaged(src: Path, tmp_path: Path, suffix: str, edit) -> Path:  # noqa: ANN001
    """A copy of src whose NAME.suffix bytes are replaced by edit(tensor), written in place (same layout); its
    provenance.json hashes updated, so that only the damage is left to find."""
    dst = tmp_path / f"{src.name}-{suffix}"
    shutil.copytree(src, dst)
    ref = Checkpoint(dst).quantized(NAME)
    component = next(c for c in ref.components if c.suffix == suffix)
    loc = component.location
    with open(loc.path, "r+b") as f:
        f.seek(loc.offset)
        t = torch.frombuffer(bytearray(f.read(loc.length)), dtype=component.dtype)
        f.seek(loc.offset)
        f.write(edit(t.clone()).contiguous().numpy().tobytes())
    record = json.loads((dst / hashing.PROVENANCE).read_text())
    record[hashing.HASHES] = {n: hashing.sha256_file(dst / n) for n in record[hashing.HASHES]}
    (dst / hashing.PROVENANCE).write_text(json.dumps(record))
    return dst


@pytest.mark.parametrize("scheme, suffix, edit, message", [
    ("int8", "scale", lambda t: t.fill_(float("nan")), "scale holds NaN or infinite values"),
    ("int8", "scale", lambda t: t.fill_(float("inf")), "scale holds NaN or infinite values"),
    ("int8", "scale", lambda t: t * 1e30, "weights beyond float16's range"),
    ("int8", "scale", lambda t: -t, "scale holds negative values"),
    ("int4", "zero", lambda t: t.fill_(float("nan")), "zero holds NaN or infinite values"),
    ("int4", "scale", lambda t: -t, "scale holds negative values"),
    ("int4", "scale", lambda t: t.fill_(60000.0), "weights beyond float16's range"),
], ids=["int8-nan-scale", "int8-inf-scale", "int8-scale-x1e30", "int8-negative-scale", "int4-nan-zero",
        "int4-negative-scale", "int4-huge-scale"])
def test_a_damaged_scale_or_zero_is_refused_when_the_checkpoint_opens(compressed, tmp_path, scheme, suffix, edit,
                                                                       message) -> None:
    path = _damaged(compressed[scheme], tmp_path, suffix, edit)
    with pytest.raises(CheckpointError, match=message) as err:
        Engine(EngineConfig(path, max_batch_size=2))
    assert NAME in str(err.value) and "model.safetensors" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded"])
def test_int8_codes_of_minus_128_are_refused_where_they_are_read(compressed, tmp_path, single_thread,
                                                                  offloaded) -> None:
    path = _damaged(compressed["int8"], tmp_path, "qweight", lambda t: t.fill_(-128))
    extra = dict(device_memory="2MiB", max_seq_len=40, num_draft_tokens=0) if offloaded else {}
    with pytest.raises((CheckpointError, PipelineError), match="qweight holds code -128") as err:
        Engine(EngineConfig(path, max_batch_size=2, **extra)).generate([[1, 5, 9]], GREEDY)
    assert NAME in str(err.value)


def test_a_file_swapped_after_it_was_built_is_refused(compressed, tiny_models, tmp_path, monkeypatch) -> None:
    path = tmp_path / "swapped"
    shutil.copytree(compressed["int8"], path)
    assert len(Engine(EngineConfig(path, max_batch_size=2)).generate([[1, 5]], GREEDY)) == 1  # verified, cached
    other = tmp_path / "other"
    quantize_checkpoint(tiny_models["llama_tied"], other, weight_format("int8"))
    shutil.copy(other / "model.safetensors", path / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors does not match the SHA-256 its provenance.json"):
        Checkpoint(path)
    monkeypatch.setenv(hashing.SKIP_HASH_ENV, "1")  # the switch: run it anyway
    Checkpoint(path)


def test_resume_refuses_a_weights_file_swapped_mid_job(compressed, tiny_models, tmp_path, capsys) -> None:
    from specoffload.runtime.cli import main

    model = tmp_path / "model"
    shutil.copytree(compressed["int8"], model)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": [1, 5 + i]}) + "\n" for i in range(8)))
    out = tmp_path / "o.jsonl"
    args = ["generate", "--model", str(model), "--prompts", str(prompts), "-o", str(out), "--max-tokens", "3",
            "--chunk-size", "4"]
    assert main(args) == 0
    out.write_text("".join(out.read_text().splitlines(keepends=True)[:4]))  # a job stopped after 4 rows
    other = tmp_path / "other"
    quantize_checkpoint(tiny_models["llama_tied"], other, weight_format("int8"))
    shutil.copy(other / "model.safetensors", model / "model.safetensors")
    assert main([*args, "--resume"]) != 0
    assert "does not match the SHA-256" in capsys.readouterr().err
    assert sum(1 for _ in out.open()) == 4  # nothing appended from the swapped weights
