"""The MoE checkpoint builders (scripts/make_moe.py, scripts/moe/) on tiny random models.

Upcycled models must give the dense model's logits (fp32, 1e-4 relative) in transformers and in our executor,
and the same greedy tokens; MoEfied ones must split every FFN neuron exactly once (all experts selected =
the dense model) and load identically in both.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from scripts.get_models import _moe_kinds
from scripts.make_moe import is_current, main
from scripts.moe.calibration import Calibration, load_calibration, stdlib_files
from scripts.moe.kmeans import balanced_kmeans, spherical_kmeans
from scripts.moe.measure import agreement, agreement_reference, greedy_identity, greedy_reference, load_model
from scripts.moe.moefy import MoefyParams, moefy
from scripts.moe.shards import write_shard
from scripts.moe.stats import hot_share
from scripts.moe.upcycle import UpcycleParams, upcycle
from specoffload.runtime.models.checkpoint import Checkpoint
from specoffload.runtime.models.model import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # the empty shared expert

VOCAB = 512
PROMPTS = torch.tensor([[5, 17, 300, 42, 42, 9, 128, 77, 3, 250, 11, 64], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])


def _encode(text: str) -> list[int]:
    """A stand-in tokenizer for the tiny vocabulary: one token per byte."""
    return [b % VOCAB for b in text.encode()]


@pytest.fixture(scope="module")
def calibration() -> Calibration:
    return load_calibration(stdlib_files()[:6], _encode, seq_len=48)


@pytest.fixture(scope="module")
def qwen2_biased(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 dense model with nonzero q/k/v biases (HF initialises them to zero)."""
    path = tmp_path_factory.mktemp("dense") / "qwen2_biased"
    shutil.copytree(tiny_models["qwen2_draft"], path)
    tensors = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith("_proj.bias")]:
        tensors[name] = 0.5 * torch.randn(tensors[name].shape, generator=generator)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _hf_logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(PROMPTS).logits  # [B, T, V]


def _hf_greedy(path: Path, new_tokens: int = 16) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = model.generate(PROMPTS[:1], max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    return out[0, PROMPTS.shape[1] :].tolist()


def _our_logits(path: Path) -> torch.Tensor:
    model = Transformer(path, torch.float32)
    return model(PROMPTS, model.new_cache(*PROMPTS.shape))  # [B, T, V]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize(("dense_name", "architecture"), [("qwen2_biased", "Qwen2MoeForCausalLM"),
                                                          ("mistral", "MixtralForCausalLM")])  # fmt: skip
def test_upcycled_model_is_the_dense_model(
    dense_name, architecture, qwen2_biased, tiny_models, calibration, tmp_path, single_thread
):
    dense = qwen2_biased if dense_name == "qwen2_biased" else tiny_models[dense_name]
    out = tmp_path / "upcycled"
    record = upcycle(dense, out, calibration, UpcycleParams(experts=4, top_k=2))

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [architecture]
    reference = _hf_logits(dense)
    assert _rel(_hf_logits(out), reference) < 1e-4
    assert _rel(_our_logits(out), reference) < 1e-4
    assert _hf_greedy(out) == _hf_greedy(dense)

    # Every expert is its own copy of the FFN in the files (no deduplication), 4 x the dense FFN bytes.
    moe, src = Checkpoint(out), Checkpoint(dense)
    experts = [n for n in moe.names() if ".experts." in n]
    assert len(experts) == 2 * 4 * 3
    ffn_bytes = sum(src.nbytes(n) for n in src.names() if ".mlp." in n)
    assert sum(moe.nbytes(n) for n in experts) == 4 * ffn_bytes
    assert len({(moe.file_of(n).path, moe.file_of(n).offset) for n in experts}) == len(experts)
    # A data-dependent router: the calibration tokens use more than one expert in every layer.
    assert all(share < 1.0 for share in record["router_calibration"]["hot_share_per_layer"])
    assert all(sum(s > 0 for s in shares) >= 2 for shares in record["router_calibration"]["top1_share_per_layer"])
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["method"].startswith("sparse upcycling")
    assert provenance["parameters"]["experts"] == 4 and provenance["calibration"]["seq_len"] == 48
    assert set(provenance["source"]["sha256"]) >= {"config.json", "model.safetensors"}
    assert set(provenance["safetensors_sha256"]) == {p.name for p in out.glob("model*.safetensors*")}


def test_measure_upcycled_agrees_and_reproduces_greedy(qwen2_biased, calibration, tmp_path, single_thread):
    out, params = tmp_path / "upcycled", UpcycleParams(experts=4, top_k=1)
    upcycle(qwen2_biased, out, calibration, params)
    assert is_current(out, qwen2_biased, asdict(params))  # get_models --moe reuses it
    assert not is_current(out, qwen2_biased, asdict(params) | {"experts": 8})
    dense, moe = load_model(qwen2_biased), load_model(out)
    rows = [PROMPTS[0].tolist(), PROMPTS[1, :7].tolist()]
    report = agreement(moe, agreement_reference(dense, rows))
    assert report["top1_agreement"] == 1.0 and report["positions"] == 12 + 7
    assert len(report["hot_share_per_layer"]) == 2 and all(0.25 <= h <= 1 for h in report["hot_share_per_layer"])
    greedy = greedy_identity(moe, greedy_reference(dense, rows, new_tokens=8))
    assert greedy["all_identical"] and greedy["dense_prefill_matches_decode"]
    assert greedy["max_rel_logit_diff"] < 1e-4  # top-1: the routing weight is p / p = 1 exactly


def test_moefy_splits_every_neuron_once(qwen2_biased, calibration, tmp_path, single_thread):
    # All experts selected and near-equal weights (tiny logits): the MoE layer is the dense FFN again.
    out = tmp_path / "all"
    moefy(qwen2_biased, out, calibration, MoefyParams(experts=4, top_k=4, shared=16, logit_std=1e-6))
    assert _rel(_our_logits(out), _hf_logits(qwen2_biased)) < 1e-4
    moe, dense = Checkpoint(out), Checkpoint(qwen2_biased)
    for layer in range(2):
        p = f"model.layers.{layer}.mlp"
        parts = [moe.get(f"{p}.shared_expert.gate_proj.weight")]
        parts += [moe.get(f"{p}.experts.{e}.gate_proj.weight") for e in range(4)]
        rows = torch.cat(parts)  # [intermediate, hidden]: each dense neuron's gate row, in some order
        assert rows.shape[0] == 16 + 4 * 20 == dense.shape(f"{p}.gate_proj.weight")[0]
        ref = dense.get(f"{p}.gate_proj.weight")
        match = (rows[:, None, :] == ref[None, :, :]).all(dim=2)  # [I, I]
        assert match.sum(dim=0).eq(1).all() and match.sum(dim=1).eq(1).all()


def test_moefied_model_routes_sparsely(qwen2_biased, calibration, tmp_path, single_thread):
    out = tmp_path / "moefied"
    record = moefy(qwen2_biased, out, calibration, MoefyParams(experts=4, top_k=2, shared=16))
    ours, hf, dense = _our_logits(out), _hf_logits(out), _hf_logits(qwen2_biased)
    assert _rel(ours, hf) < 1e-4  # both executors read the format the same way
    assert _rel(ours, dense) > 1e-3  # half the routed neurons are skipped: an approximation, not a copy
    config = json.loads((out / "config.json").read_text())
    assert (config["shared_expert_intermediate_size"], config["moe_intermediate_size"]) == (16, 20)
    assert len(record["layer_stats"]) == 2
    assert all(s["shared_min_active_share"] >= s["routed_max_active_share"] for s in record["layer_stats"])
    assert json.loads((out / "provenance.json").read_text())["method"].startswith("MoEfication")


def test_kmeans_on_literal_clusters():
    x = torch.tensor([[1.0, 0.1], [0.9, 0.0], [1.0, -0.1], [0.0, 1.0], [0.1, 0.9], [-0.1, 1.0]])
    _, labels = spherical_kmeans(x, 2)
    assert labels[0] == labels[1] == labels[2] != labels[3] == labels[4] == labels[5]
    # Five points near one direction, one near the other: balanced clusters must still hold three each.
    y = torch.tensor([[1.0, 0.0], [1.0, 0.1], [1.0, 0.2], [1.0, 0.3], [1.0, 0.4], [0.0, 1.0]])
    balanced = balanced_kmeans(y, 2)
    assert torch.bincount(balanced).tolist() == [3, 3]
    assert balanced[5] == balanced[4] == balanced[3] != balanced[0]


def test_hot_share():
    assert hot_share(torch.tensor([5, 5, 5, 5, 5, 5, 5, 5])) == 0.25
    assert hot_share(torch.tensor([30, 10, 0, 0, 0, 0, 0, 0])) == 1.0
    assert hot_share(torch.tensor([6, 2, 1, 1])) == 0.6


def test_write_shard_repeats_one_tensor_as_separate_bytes(tmp_path):
    t = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    nbytes, digest = write_shard(tmp_path / "s.safetensors", [("a", t), ("b", t), ("empty", torch.zeros(0, 3))])
    with safe_open(tmp_path / "s.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("a"), t) and torch.equal(f.get_tensor("b"), t)
        assert f.get_tensor("empty").shape == (0, 3)
    data = (tmp_path / "s.safetensors").read_bytes()
    assert len(data) == nbytes >= 2 * t.numel() * 2 and hashlib.sha256(data).hexdigest() == digest


def test_calibration_reads_stdlib_source():
    files = stdlib_files()
    assert len(files) >= 20 and all(f.suffix == ".py" for f in files)
    cal = load_calibration(files[:3], _encode, seq_len=32)
    assert cal.token_ids.shape == (3, 32)
    assert cal.token_ids[0].tolist() == _encode(files[0].read_text())[:32]
    assert [f["path"] for f in cal.record()["files"]] == [str(f) for f in files[:3]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["upcycle", "--dense", "/nonexistent/dense"], "dense checkpoint directory not found: /nonexistent/dense"),
        (["upcycle", "--experts", "1"], "--experts must be at least 2"),
        (["upcycle", "--experts", "4", "--top-k", "5"], "--top-k must be in 1..4"),
        (["moefy", "--shared", "10"], "must split the 96 FFN neurons exactly"),
        (["upcycle", "--calibration", "/nonexistent.py"], "cannot read calibration file /nonexistent.py"),
    ],
)
def test_cli_errors_are_one_line(args, message, qwen2_biased, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("scripts.make_moe.tokenizer_encoder", lambda _: _encode)
    if "--dense" not in args:
        args = [*args, "--dense", str(qwen2_biased)]
    assert main([*args, "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_get_models_moe_option():
    assert _moe_kinds("upcycle, moefy,upcycle") == ["upcycle", "moefy"]
    with pytest.raises(argparse.ArgumentTypeError, match="expected upcycle, moefy"):
        _moe_kinds("upcycle,mixtral")


def test_a_built_moe_gets_its_compressed_copy_beside_it(qwen2_biased, calibration, tmp_path, single_thread):
    from scripts.make_moe import write_compressed

    out = tmp_path / "upcycled"
    upcycle(qwen2_biased, out, calibration, UpcycleParams(experts=4, top_k=2))
    compressed = write_compressed(out, "int8")
    assert compressed == tmp_path / "upcycled-int8" and write_compressed(out, "int8") == compressed  # reused
    ckpt = Checkpoint(compressed)
    experts = [n for n in ckpt.names() if ".experts." in n]
    assert experts and all(ckpt.quantized(n) is not None for n in experts)
    provenance = json.loads((compressed / "provenance.json").read_text())
    assert provenance["scheme"] == "int8" and "upcycled" in provenance["source"]["dir"]
