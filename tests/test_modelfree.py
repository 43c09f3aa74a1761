"""Model-free drafters (runtime/offload/modelfree.py, matching.py): the pure matching code against brute-force
definitions (hypothesis), the drafters' bookkeeping, losslessness in both runners (greedy: token for token the
target's own output), exact sampling with deterministic drafts (chi-square, with a broken verifier the same test
rejects), and what the rest of the engine asks of them (no footprint, no actor, one batch by default)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from specoffload.runtime import speculative
from specoffload.runtime.config import ConfigError, EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.models.model import Transformer
from specoffload.runtime.offload.drafters import DRAFTERS
from specoffload.runtime.offload.drafters.modelfree import NO_TOKEN, NgramDrafter, SuffixDrafter
from specoffload.runtime.offload.matching import NgramIndex, SuffixIndex, ngram_reference, suffix_reference
from specoffload.runtime.planning import ModelPair
from specoffload.runtime.sampling import SamplingParams
from specoffload.runtime.speculative import cut_drafts, verify_rows

# ------------------------------------------------------------------------------------------------ pure matching

tokens_st = st.lists(st.integers(0, 3), max_size=40)  # a small vocabulary: many matches


def test_ngram_literal_cases():
    assert ngram_reference([1, 2, 3, 4, 1, 2], 1, 3, 4) == [3, 4, 1, 2]  # the 2-gram [1, 2] at 0
    assert ngram_reference([1, 2, 3, 1, 2, 9, 1, 2], 1, 3, 2) == [9, 1]  # the most recent occurrence wins
    assert ngram_reference([5, 6, 7], 1, 3, 4) == []  # no earlier occurrence
    assert ngram_reference([7, 7, 7], 2, 2, 4) == [7]  # overlapping the suffix: what is left after it
    assert ngram_reference([1, 2, 9, 2], 2, 3, 4) == []  # only a 1-gram matches, below min_n


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(tokens_st, st.integers(0, 45)), min_size=1, max_size=6),
       n=st.tuples(st.integers(1, 4), st.integers(0, 3)), k=st.integers(0, 6))
def test_ngram_index_equals_the_brute_force_definition(ops, n, k):
    """Whatever the appends and truncations, the incremental index proposes what the definition does."""
    min_n, max_n = n[0], n[0] + n[1]
    index = NgramIndex(min_n, max_n)
    for new, keep in ops:
        index.extend(new)
        assert index.propose(k) == ngram_reference(index.tokens, min_n, max_n, k)
        index.truncate(keep)
        assert index.propose(k) == ngram_reference(index.tokens, min_n, max_n, k)
    fresh = NgramIndex(min_n, max_n)
    fresh.extend(index.tokens)
    assert fresh.table == index.table  # truncation left exactly the index of what is kept


def test_ngram_index_with_every_hash_colliding_still_equals_the_definition(monkeypatch):
    """Keys are hashes: with one hash for every n-gram the candidates' tokens decide, so proposals do not change."""
    from specoffload.runtime.offload import matching

    monkeypatch.setattr(matching, "hash", lambda _: 7, raising=False)
    rng = random.Random(3)
    tokens = [rng.randrange(4) for _ in range(80)]
    for min_n, max_n in ((1, 1), (1, 3), (2, 5)):
        index = NgramIndex(min_n, max_n)
        for end in range(len(tokens)):
            index.extend(tokens[end:end + 1])
            assert index.propose(4) == ngram_reference(index.tokens, min_n, max_n, 4)
        assert len(index.table) == 1


def test_ngram_index_is_linear_in_the_row():
    """(max_n - min_n + 1) entries per token at most, each an int key and a position: a 1,200-token prompt at the
    largest lookup holds no n-gram tuples (before: 2.7 GB at max 100000)."""
    from specoffload.runtime.offload.drafters.modelfree import MAX_LOOKUP

    rng = random.Random(0)
    index = NgramIndex(1, MAX_LOOKUP)
    index.extend([rng.randrange(50) for _ in range(1200)])
    assert all(type(key) is int for key in index.table)
    assert sum(len(v) for v in index.table.values()) <= 1200 * MAX_LOOKUP


def test_suffix_literal_case():
    """After [1, 2] the corpus continues with 3 twice and 4 once: propose 3 (p = 2/3), then 5 (p = 2/3 * 1)."""
    corpus = [1, 2, 3, 5, -1, 1, 2, 3, 5, -1, 1, 2, 4]
    index = SuffixIndex()
    index.extend(corpus)
    got = index.propose([0, 1, 2], 4, 8, 0.1, 4.0)
    assert got.tokens == (3, 5) and got.match == 2  # a separator ends the walk
    assert got.probs == pytest.approx((2 / 3, 2 / 3)) and got.score == pytest.approx(4 / 3)
    assert index.propose([0, 1, 2], 4, 8, 0.7, 4.0).tokens == ()  # 2/3 is below the threshold
    assert index.propose([0, 1, 2], 4, 8, 0.1, 0.5).tokens == (3,)  # at most ceil(0.5 * 2) tokens


@settings(max_examples=300, deadline=None)
@given(corpus=st.lists(st.integers(-1, 3), max_size=50), query=st.lists(st.integers(0, 3), min_size=1, max_size=8),
       k=st.integers(0, 5), depth=st.integers(1, 6), min_prob=st.sampled_from([0.0, 0.2, 0.5]),
       factor=st.sampled_from([0.5, 1.0, 3.0]), keep=st.integers(0, 50))
def test_suffix_index_equals_the_brute_force_definition(corpus, query, k, depth, min_prob, factor, keep):
    index = SuffixIndex()
    index.extend(corpus)
    assert index.propose(query, k, depth, min_prob, factor) == suffix_reference(corpus, query, k, depth, min_prob,
                                                                                factor)
    own = index.tokens  # a row against its own index (its suffix is its own last position: never a match)
    assert index.propose(own, k, depth, min_prob, factor) == suffix_reference(own, own, k, depth, min_prob, factor)
    index.truncate(keep)
    fresh = SuffixIndex()
    fresh.extend(corpus[:keep])
    assert (index.unigrams, index.bigrams) == (fresh.unigrams, fresh.bigrams)


def test_cut_drafts():
    assert cut_drafts([3, 3, 0, 2], torch.tensor([5, -1, 7, -1]), 0) == [3, 0, 0, 0]
    assert cut_drafts([3, 3], torch.tensor([-1, 4]), 2) == [2, 3]


# ------------------------------------------------------------------------------------------------ the drafters


def test_a_round_hands_out_each_rows_proposal_then_no_token():
    drafter = NgramDrafter(max_tokens=3, min_n=1, max_n=2)
    drafter.reset(0, 2, 64)
    assert drafter.lengths(0) == [0, 0]
    ids = torch.tensor([[4, 5, 6, 4, 5], [7, 8, 9, 0, 0]])  # row 1: three tokens, no repeat
    first, probs = drafter.propose(0, ids, torch.tensor([5, 3]), SamplingParams(temperature=0.0))
    assert probs is None and first.tolist() == [6, NO_TOKEN]
    second, _ = drafter.propose(0, first[:, None], torch.ones(2, dtype=torch.long), SamplingParams(temperature=0.0))
    assert second.tolist() == [4, NO_TOKEN]  # [6, 4, 5]: what followed [4, 5]
    drafter.truncate(0, [5, 3])  # the target rejected everything: back to the committed tokens
    assert drafter.lengths(0) == [5, 3] and drafter.rows[0][0].tokens == [4, 5, 6, 4, 5]
    drafter.reset_rows(0, [1], 64)
    assert drafter.lengths(0) == [5, 0]


def test_suffix_drafter_learns_from_finished_rows():
    """A row's output joins the global index when it leaves; a new row with the same context then proposes it."""
    drafter = SuffixDrafter(max_tokens=4, max_depth=8, min_prob=0.1, spec_factor=4.0)
    drafter.reset(0, 1, 64)
    drafter.lengths(0)
    drafter.propose(0, torch.tensor([[10, 11, 12]]), torch.tensor([3]),
                    SamplingParams(temperature=0.0))  # prompt + 1st token
    drafter.truncate(0, [3])
    drafter.lengths(0)
    drafter.propose(0, torch.tensor([[13, 14, 15, 16]]), torch.tensor([4]),
                    SamplingParams(temperature=0.0))  # its output
    drafter.reset_rows(0, [0], 64)  # it finished: [12, 13, 14, 15, 16] is an output now
    assert drafter.outputs == [[12, 13, 14, 15, 16]]
    drafter.lengths(0)
    token, _ = drafter.propose(0, torch.tensor([[1, 13, 14]]), torch.tensor([3]), SamplingParams(temperature=0.0))
    assert token.tolist() == [15] and drafter.last.tokens == (15, 16) and drafter.last.score > 0


def test_model_free_drafters_are_registered_and_hold_nothing(tiny_models):
    assert DRAFTERS["ngram"] is NgramDrafter and DRAFTERS["suffix"] is SuffixDrafter
    target = Transformer(tiny_models["llama"])
    for name in ("ngram", "suffix"):
        config = EngineConfig(tiny_models["llama"], drafter=name, device_memory="1GiB")
        assert config.drafter_class.model_free and config.interleave is False  # one batch by default
        assert EngineConfig(tiny_models["llama"], drafter=name, interleave=True).interleave is True
        pair = ModelPair.for_config(config, target, shares_kv=False)
        assert pair.draft is not None and pair.draft.total_bytes == 0 and pair.draft.kv_bytes_per_token == 0
    assert EngineConfig(tiny_models["llama"], draft=tiny_models["qwen2_draft"]).interleave is True


def test_model_free_frees_the_draft_models_memory_for_rows(tiny_models):
    """Under one budget the planner's placement holds more rows with ngram than with a draft model."""
    from specoffload.planner.placement import place
    from specoffload.planner.plan import fixed_plan
    from specoffload.runtime.planning import placement_policy

    target = Transformer(tiny_models["llama"])
    model = EngineConfig(tiny_models["llama"], draft=tiny_models["qwen2_draft"], device_memory="1GiB",
                         interleave=False)
    ngram = EngineConfig(tiny_models["llama"], drafter="ngram", device_memory="1GiB")
    plan = fixed_plan(4, 2, 64, interleave=False)
    device = {}
    for name, config in (("model", model), ("ngram", ngram)):
        models = ModelPair.for_config(config, target, shares_kv=True)
        placement = place(models.target, models.draft, placement_policy(config, plan, models), 1 << 30, 1 << 30)
        device[name] = placement.device_bytes()
    assert device["ngram"] < device["model"]


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(prompt_lookup_min=0), "prompt_lookup_min"),
    (dict(prompt_lookup_min=4, prompt_lookup_max=3), "1 <= min <= max"),
    (dict(prompt_lookup_max=100000), "max <= 32"),
    (dict(suffix_min_prob=1.5), "suffix_min_prob"),
    (dict(suffix_max_depth=0), "suffix_max_depth"),
    (dict(suffix_spec_factor=0), "suffix_spec_factor"),
])
def test_bad_settings_are_one_config_error(tiny_models, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(tiny_models["llama"], drafter="ngram", drafter_options=kwargs)


# ------------------------------------------------------------------------------------------------ lossless

#: prompts that repeat themselves, so that prompt lookup and suffix matching find matches from the first round
REPEATING = [([1, 5 + i, 9, 33 + 2 * i, 70 + i][: 2 + i % 4] * 3)[: 4 + i] for i in range(7)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def no_draft(tiny_models):  # noqa: ANN001, ANN201
    cache: dict[str, list[list[int]]] = {}

    def get(target: str) -> list[list[int]]:
        if target not in cache:
            engine = Engine(EngineConfig(tiny_models[target], max_batch_size=3))
            cache[target] = [r.token_ids for r in engine.generate(REPEATING, GREEDY)]
        return cache[target]

    return get


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
@pytest.mark.parametrize(("target", "offloaded"), [("llama", False), ("llama", True), ("mixtral", True)])
def test_greedy_is_the_targets_own_output(tiny_models, single_thread, no_draft, drafter, target, offloaded):
    extra = dict(device_memory="1GiB", max_seq_len=48, replan_interval=0) if offloaded else {}
    engine = Engine(EngineConfig(tiny_models[target], drafter=drafter, max_batch_size=3, num_draft_tokens=3,
                                 **extra))
    out = [r.token_ids for r in engine.generate(REPEATING, GREEDY)]
    assert out == no_draft(target)
    drafter_obj = engine.workers.drafter
    assert isinstance(drafter_obj, DRAFTERS[drafter])
    assert 0 < drafter_obj.matched < drafter_obj.proposed  # some rows matched, some proposed nothing
    stats = engine.last_stats
    assert stats.num_drafted > 0 and stats.num_accepted <= stats.num_drafted
    engine.close()


def test_sampled_rows_are_reproducible_with_ngram(tiny_models, single_thread):
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    runs = []
    for batch in (1, 3):  # a row's proposals and draws are its own: the batch does not matter
        engine = Engine(EngineConfig(tiny_models["llama"], drafter="ngram", max_batch_size=batch,
                                     num_draft_tokens=3))
        runs.append([r.token_ids for r in engine.generate(REPEATING, params)])
        assert engine.last_stats.num_drafted > 0
    assert runs[0] == runs[1]


# ------------------------------------------------------------------------------------------------ exact sampling

N = 20_000
PASS_P, FAIL_P = 1e-3, 1e-6
Q_TABLE = torch.tensor([
    [0.40, 0.25, 0.15, 0.10, 0.10],
    [0.05, 0.10, 0.40, 0.25, 0.20],
    [0.20, 0.20, 0.05, 0.25, 0.30],
    [0.10, 0.30, 0.10, 0.30, 0.20],
])  # [positions, vocab]: the target's distribution at each absolute position
VOCAB = Q_TABLE.shape[1]


def _proposal(position: int) -> int:
    """The deterministic draft at an absolute position (a likely token at 0, an unlikely one at 1, ...)."""
    return [0, 0, 4, 1][position]


@pytest.mark.parametrize("wrong", [False, True], ids=["one_hot", "p_zero"])
def test_deterministic_drafts_keep_sampling_exact(monkeypatch, wrong):
    """Rows decode two windows of k = 2 deterministic drafts (p=None: a point mass on each); the first two emitted
    tokens must be distributed as Q_0(x) Q_1(y). Treating the drafts as p = 0 (accepted whenever q > 0) is biased
    and the same test rejects it."""
    if wrong:
        monkeypatch.setattr(speculative, "one_hot_drafts", lambda d, v, t: torch.zeros((*d.shape, v), dtype=t))
    torch.manual_seed(5)  # (seeds=None: the global generator)
    k = 2
    rows = torch.arange(N)
    emitted = torch.full((N, 2 * (k + 1)), -1)
    count = torch.zeros(N, dtype=torch.long)
    for _ in range(2):
        positions = count[:, None] + torch.arange(k + 1)  # [N, k + 1]
        q = Q_TABLE[positions.clamp(max=len(Q_TABLE) - 1)]  # [N, k + 1, vocab]
        drafts = torch.tensor([[_proposal(min(int(c) + i, 3)) for i in range(k)] for c in count])  # [N, k]
        accepted, tokens = verify_rows(q.log(), drafts, [k] * N, None, SamplingParams(temperature=1.0), None)
        out = torch.tensor(tokens)  # [N, k + 1], -1 after the emitted ones
        valid = out >= 0
        emitted[rows[:, None].expand_as(valid)[valid], positions[valid]] = out[valid]
        count += torch.tensor(accepted) + 1
    joint = emitted[:, 0] * VOCAB + emitted[:, 1]  # [N]
    observed = torch.bincount(joint, minlength=VOCAB * VOCAB).double()
    expected = torch.outer(Q_TABLE[0], Q_TABLE[1]).flatten().double()
    expected = expected / expected.sum() * int(observed.sum())
    pvalue = float(chisquare(observed.numpy(), expected.numpy()).pvalue)
    if wrong:
        assert pvalue < FAIL_P
    else:
        assert pvalue > PASS_P
