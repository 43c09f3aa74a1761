"""The drafter registry (runtime/offload/drafters.py `DRAFTERS`): a config names its drafter, the registry gives the
class, and config, planning, profiler and engine ask that class, never the name. A new drafter is one class and
one `register_drafter` line; whatever it proposes, greedy output stays the target's own."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from specoffload.runtime.cli import main
from specoffload.runtime.config import ConfigError, EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.models.config import ModelConfig
from specoffload.runtime.models.model import Transformer
from specoffload.runtime.offload.drafters import (
    DRAFTERS,
    DrafterTraits,
    NoDrafter,
    drafter_class,
    option,
    register_drafter,
)
from specoffload.runtime.offload.drafters.model import ModelDrafter
from specoffload.runtime.offload.drafters.resident_experts import ResidentExpertDrafter
from specoffload.runtime.offload.profiler import draft_key, fingerprint
from specoffload.runtime.planning import ModelPair
from specoffload.runtime.sampling import SamplingParams
from tests.conftest import OFFLOAD_PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)  # as conftest's resident_greedy
FIXED_TOKEN = 3


@dataclass(frozen=True)
class FixedTokenOptions:
    """The toy drafter's one setting: a config key and a CLI flag (--fixed-token) by this declaration alone."""

    fixed_token: int = option(FIXED_TOKEN, "the token it proposes")

    def __post_init__(self) -> None:
        if not isinstance(self.fixed_token, int) or self.fixed_token < 0:
            raise ConfigError(f"fixed_token must be a token id >= 0, got {self.fixed_token!r}")


class FixedTokenDrafter(DrafterTraits):
    """Proposes its `fixed_token` (FIXED_TOKEN by default) for every row, always: no model, no cache, nothing
    placement must count (the `DrafterTraits` defaults). Sampled, its distribution is a point mass on that token."""

    options = FixedTokenOptions

    def __init__(self, config: EngineConfig, weights: object = None, slots: object = None) -> None:
        self.vocab = ModelConfig.from_dir(config.target).vocab_size
        self.token = self.settings(config).fixed_token
        self.rows: dict[int, int] = {}
        self.calls = 0

    def reset(self, batch: int, rows: int, capacity: int) -> None:
        self.rows[batch] = rows

    def drop(self, batch: int) -> None:
        self.rows.pop(batch, None)

    def lengths(self, batch: int) -> list[int]:
        return [0] * self.rows[batch]  # it keeps no tokens: each round feeds it every committed token

    def truncate(self, batch: int, lengths: Sequence[int]) -> None:
        pass

    def select_rows(self, batch: int, keep: Sequence[int]) -> None:
        self.rows[batch] = len(keep)

    def reset_rows(self, batch: int, rows: Sequence[int], capacity: int) -> None:
        pass

    def propose(self, batch: int, ids: torch.Tensor, num_new: torch.Tensor, params: SamplingParams,
                seeds: Sequence[int] | None = None,
                warps: Sequence[Sequence[float]] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.calls += 1
        token = torch.full((ids.shape[0],), self.token, dtype=torch.long)  # [rows]
        if params.greedy:
            return token, None
        return token, torch.nn.functional.one_hot(token, self.vocab).float()  # [rows, vocab]

    def adapt(self, routing_counts: list[list[int]]) -> list[int]:
        return [0, 0, 0, 0]


@pytest.fixture(autouse=True)
def fixed_token_registered():
    """FixedTokenDrafter is registered for this module's tests only (auto-choice elsewhere compares every
    registered drafter)."""
    register_drafter("fixed-token", FixedTokenDrafter)
    yield
    DRAFTERS.pop("fixed-token", None)


def _offloaded(tiny_models, target: str, **kw) -> EngineConfig:  # noqa: ANN001
    base = dict(target=tiny_models[target], device_memory="1GiB", max_batch_size=2, max_seq_len=48,
                num_draft_tokens=2)
    return EngineConfig(**(base | kw))


def test_the_registry_resolves_none_model_and_self(tiny_models):
    assert {"none": NoDrafter, "model": ModelDrafter, "self": ResidentExpertDrafter}.items() <= DRAFTERS.items()
    cases = [
        (EngineConfig(tiny_models["llama"]), "none", NoDrafter),
        (EngineConfig(tiny_models["llama"], draft=tiny_models["qwen2_draft"]), "model", ModelDrafter),
        (EngineConfig(tiny_models["llama"], draft=tiny_models["qwen2_draft"], drafter="model"), "model", ModelDrafter),
        (EngineConfig(tiny_models["mixtral"], draft="self", device_memory="1GiB"), "self", ResidentExpertDrafter),
        (EngineConfig(tiny_models["mixtral"], drafter="self", device_memory="1GiB"), "self", ResidentExpertDrafter),
        (EngineConfig(tiny_models["llama"], drafter="none"), "none", NoDrafter),
        (_offloaded(tiny_models, "llama", drafter="fixed-token"), "fixed-token", FixedTokenDrafter),
    ]
    for config, name, cls in cases:
        assert (config.drafter_name, config.drafter_class, drafter_class(config)) == (name, cls, cls)


def test_an_unknown_drafter_is_one_config_error_listing_the_names(tiny_models):
    with pytest.raises(ConfigError) as info:
        EngineConfig(tiny_models["llama"], drafter="medusa")
    message = str(info.value)
    assert "'medusa'" in message and "\n" not in message
    assert "fixed-token, lowbit, model, ngram, none, self, suffix" in message  # every registered name, sorted


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(drafter="model"), "draft must be its checkpoint directory"),
    (dict(drafter="none", draft="qwen2_draft"), "loads no checkpoint"),
    (dict(drafter="model", draft="self"), "draft='self' is the 'self' drafter"),
    (dict(drafter="fixed-token", device_memory=None), "needs device_memory"),
    (dict(drafter=3), "registered drafter's name"),
])
def test_a_drafter_gets_what_its_class_needs(tiny_models, kwargs, match):
    if kwargs.get("draft") == "qwen2_draft":
        kwargs["draft"] = tiny_models["qwen2_draft"]
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**({"target": tiny_models["llama"], "device_memory": "1GiB"} | kwargs))


def test_register_drafter_refuses_an_incomplete_class_and_a_taken_name():
    class ProposesOnly(DrafterTraits):
        def propose(self, batch, ids, num_new, params, seeds=None):  # noqa: ANN001, ANN201
            return ids[:, -1], None

    with pytest.raises(TypeError, match="lacks reset, drop, lengths"):
        register_drafter("proposes-only", ProposesOnly)
    with pytest.raises(ValueError, match="taken by ModelDrafter"):
        register_drafter("model", FixedTokenDrafter)
    assert register_drafter("fixed-token", FixedTokenDrafter) is FixedTokenDrafter  # the same again: a no-op
    assert "proposes-only" not in DRAFTERS


def test_planning_and_the_profile_ask_the_class(tiny_models):
    """The footprint placement counts and the profile's draft key come from the drafter class: the same as before
    for self and model drafts, nothing for a drafter without weights."""
    target = Transformer(tiny_models["mixtral"])
    self_config = EngineConfig(tiny_models["mixtral"], draft="self", device_memory="1GiB",
                               drafter_options={"resident_experts": 2})
    assert ModelPair.for_config(self_config, target, shares_kv=True) == ModelPair.of(target, None, 2, shares_kv=True)
    assert ModelPair.for_config(self_config, target, shares_kv=False) == ModelPair.of(target, None, 2)
    model_config = EngineConfig(tiny_models["mixtral"], draft=tiny_models["qwen2_draft"])
    draft = Transformer(tiny_models["qwen2_draft"])
    assert ModelPair.for_config(model_config, target, shares_kv=True) == ModelPair.of(target, draft)
    assert ModelPair.for_config(EngineConfig(tiny_models["mixtral"]), target, True) == ModelPair.of(target, None)
    fixed = ModelPair.for_config(_offloaded(tiny_models, "mixtral", drafter="fixed-token"), target, True)
    assert fixed.draft is not None and fixed.draft.total_bytes == 0 and fixed.draft.kv_bytes_per_token == 0
    assert fixed.self_draft_experts == 0 and fixed.draft_pins == frozenset()
    configs = (self_config, model_config, EngineConfig(tiny_models["mixtral"]),
               _offloaded(tiny_models, "mixtral", drafter="fixed-token"))
    keys = [draft_key(c) for c in configs]
    assert keys == ["self:2/float32", tiny_models["qwen2_draft"].name + "/float32", "", "fixed-token/float32"]
    assert len({json.dumps(fingerprint(c), sort_keys=True) for c in configs}) == 1  # one profile for every drafter


@pytest.mark.parametrize(("target", "interleave"), [("llama", True), ("mixtral", False)])
def test_a_registered_drafter_runs_by_name_and_stays_lossless(tiny_models, single_thread, resident_greedy, target,
                                                             interleave):
    """Its drafts are almost all rejected; the output is still the target's greedy output, token for token."""
    engine = Engine(_offloaded(tiny_models, target, drafter="fixed-token", interleave=interleave, replan_interval=0))
    drafter = engine.workers.drafter
    assert isinstance(drafter, FixedTokenDrafter) and engine.plan.k == 2
    out = engine.generate(OFFLOAD_PROMPTS, GREEDY)
    assert [r.token_ids for r in out] == resident_greedy(target)
    assert drafter.calls > 0 and engine.last_stats.num_drafted > 0
    engine.close()


def test_the_cli_takes_a_drafter_by_name(tiny_models, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"token_ids": [1, 5, 9]}\n')
    rc = main(["generate", "--target", str(tiny_models["llama"]), "--prompts", str(prompts), "--drafter", "medusa",
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown drafter 'medusa'" in err and "Traceback" not in err


def test_a_drafter_declared_in_a_test_file_brings_its_options_and_flags(tiny_models, resident_greedy):
    """FixedTokenDrafter and its options are declared above, in this file alone: the config takes its option
    (checked by its own dataclass), the command line has a flag for it, and the engine runs it losslessly."""
    from specoffload.runtime import cli

    config = _offloaded(tiny_models, "llama", drafter="fixed-token", drafter_options={"fixed_token": 5})
    assert FixedTokenDrafter(config).token == 5 and FixedTokenDrafter(_offloaded(
        tiny_models, "llama", drafter="fixed-token")).token == FIXED_TOKEN
    with pytest.raises(ConfigError, match="fixed_token must be a token id"):
        _offloaded(tiny_models, "llama", drafter="fixed-token", drafter_options={"fixed_token": -1})
    with pytest.raises(ConfigError, match="unknown drafter option 'fixed_tokn'.*fixed_token"):
        _offloaded(tiny_models, "llama", drafter="fixed-token", drafter_options={"fixed_tokn": 5})
    parser = argparse.ArgumentParser()
    cli._add_drafter_options(parser)
    assert cli.drafter_options(parser.parse_args(["--fixed-token", "7", "--prompt-lookup-max", "4"])) == {
        "fixed_token": 7, "prompt_lookup_max": 4}
    assert cli.drafter_options(parser.parse_args([])) == {}
    engine = Engine(config)
    assert [r.token_ids for r in engine.generate(OFFLOAD_PROMPTS, GREEDY)] == resident_greedy("llama")
    assert engine.last_stats.num_drafted > 0


def test_config_and_cli_import_no_drafter_module():
    """The drafters are plug-ins: config.py and cli.py reach them through the registry only."""
    from tests.test_import_graph import import_graph

    graph = import_graph()
    for module in ("specoffload.runtime.config", "specoffload.runtime.cli"):
        named = sorted(m for m in graph[module] if m.startswith("specoffload.runtime.offload.drafters."))
        assert named == [], f"{module} imports {named}"
