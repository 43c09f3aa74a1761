"""Bad input gets a clear error naming the problem."""

from __future__ import annotations

import json
import shutil

import pytest

from specoffload.runtime import (
    CheckpointError,
    Engine,
    EngineConfig,
    PromptError,
    SamplingParams,
    SpecOffloadError,
    UnsupportedModelError,
    VocabularyMismatchError,
)
from specoffload.runtime.config import ConfigError


@pytest.fixture(scope="module")
def engine(tiny_models):
    return Engine(EngineConfig(target=tiny_models["llama"], draft=tiny_models["draft"], num_draft_tokens=2))


def test_empty_prompt_list(engine):
    with pytest.raises(PromptError, match="empty"):
        engine.generate([])


def test_empty_prompt(engine):
    with pytest.raises(PromptError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []])


def test_text_prompt_without_tokenizer(engine):
    with pytest.raises(PromptError, match="no tokenizer"):
        engine.generate(["hello"])


def test_prompt_longer_than_context(engine):
    n = engine.target.config.max_position_embeddings
    with pytest.raises(PromptError, match=f"prompt 0 has {n} tokens.*context is {n}"):
        engine.generate([[1] * n])


def test_out_of_vocabulary_ids(engine):
    with pytest.raises(PromptError, match="outside the vocabulary"):
        engine.generate([[1, 10**7]])


@pytest.mark.parametrize("k", [-1, 1.5, True])
def test_k_not_a_draft_length(tiny_models, k):
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        EngineConfig(target=tiny_models["llama"], draft=tiny_models["draft"], num_draft_tokens=k)


def test_bad_sampling_params():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match=str(tmp_path / "nope")):
        Engine(EngineConfig(target=tmp_path / "nope"))


def test_unsupported_architecture(tiny_models, tmp_path):
    bad = tmp_path / "gpt2ish"
    shutil.copytree(tiny_models["llama"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        Engine(EngineConfig(target=bad))


def test_vocabulary_mismatch_names_both_models(tiny_models):
    other = tiny_models["draft_other_vocab"]
    with pytest.raises(VocabularyMismatchError) as info:
        Engine(EngineConfig(target=tiny_models["llama"], draft=other))
    msg = str(info.value)
    assert str(other) in msg and str(tiny_models["llama"]) in msg


def test_errors_share_a_base_class():
    assert issubclass(PromptError, SpecOffloadError) and issubclass(VocabularyMismatchError, SpecOffloadError)
