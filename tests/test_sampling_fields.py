"""vLLM's sampling fields: names, validation, and lossless speculation for each (penalties, min_tokens, logprobs).

Penalties change the target's distribution at each position from the tokens before it, drafts included
(runtime/logits_process.py). The tests check that speculation with them equals decoding without a draft (greedy:
token for token; sampled: the chi-square test of verify's pattern), and that the tests catch the broken variant
that processes every position with the committed history only.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specoffload.runtime import Engine, EngineConfig, SamplingParams
from specoffload.runtime import logits_process as lp
from specoffload.runtime.request import Request
from specoffload.runtime.sampling import sample
from specoffload.runtime.verify import verify_sampling

PROMPTS = [[1, 5 + i, 9, 33 + 2 * i, 70 + i][: 2 + i % 4] for i in range(7)]
PENALISED = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=0.4, frequency_penalty=0.2,
                           repetition_penalty=1.2)


def test_vllm_names_and_validation() -> None:
    p = SamplingParams(temperature=0.0, max_tokens=7, stop="\n\n", top_k=-1, n=2, logprobs=3)
    assert p.max_new_tokens == p.max_tokens == 7 and p.stop == ("\n\n",) and p.top_k == 0
    assert SamplingParams(7).max_tokens == 7 and SamplingParams(temperature=0.0, max_new_tokens=7,
                                                                max_tokens=7).max_tokens == 7
    with pytest.raises(ValueError, match="give one of them"):
        SamplingParams(temperature=0.0, max_new_tokens=5, max_tokens=7)
    for bad in (dict(min_tokens=9, max_tokens=8), dict(n=0), dict(logprobs=-1), dict(presence_penalty=3.0),
                dict(frequency_penalty=float("nan")), dict(repetition_penalty=0.0), dict(stop=[""])):
        with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
            SamplingParams(**bad)


@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded"])
def test_penalties_greedy_identical_under_speculation(tiny_models, single_thread, monkeypatch, offloaded) -> None:
    """The draft is the target itself (high acceptance) but unpenalised: its drafts are rejected exactly where the
    penalised target disagrees. The output equals the no-draft run's; processing each position with the committed
    history alone (drafts left out) does not."""
    extra = dict(device_memory="2MiB", max_seq_len=40, max_batch_size=2) if offloaded else dict(max_batch_size=4)
    plain = Engine(EngineConfig(tiny_models["llama"], **extra))
    reference = [r.token_ids for r in plain.generate(PROMPTS, PENALISED)]
    unpenalised = [r.token_ids for r in plain.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24,
                                                                               ignore_eos=True))]
    assert reference != unpenalised  # the penalties matter on these prompts
    spec = Engine(EngineConfig(tiny_models["llama"], draft=tiny_models["llama"], num_draft_tokens=4, **extra))
    results = spec.generate(PROMPTS, PENALISED)
    assert [r.token_ids for r in results] == reference
    assert 0 < sum(r.num_accepted for r in results) < sum(r.num_drafted for r in results)
    committed_only = lp.history_counts
    monkeypatch.setattr(lp, "history_counts", lambda out, drafts, n, v: committed_only(out, drafts[:0], n, v))
    assert [r.token_ids for r in spec.generate(PROMPTS, PENALISED)] != reference
    plain.close()
    spec.close()


def test_min_tokens_and_logprobs_lossless(tiny_models, single_thread) -> None:
    """min_tokens masks the stop ids until that many tokens are out; logprobs are the target's, with or without a
    draft; both leave greedy speculation identical to plain decoding."""
    plain = Engine(EngineConfig(tiny_models["llama"], max_batch_size=4))
    free = plain.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stop_id = free[0].token_ids[2]  # row 0 would stop at its third token
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id], ignore_eos=True, min_tokens=6,
                            logprobs=2)
    spec = Engine(EngineConfig(tiny_models["llama"], draft=tiny_models["llama"], num_draft_tokens=3,
                               max_batch_size=4))
    ours, theirs = plain.generate(PROMPTS, params), spec.generate(PROMPTS, params)
    assert [r.token_ids for r in ours] == [r.token_ids for r in theirs]
    assert len(ours[0].token_ids) >= 6 and stop_id not in ours[0].token_ids[:6]
    for r in ours:
        if r.finish_reason == "stop":
            assert r.token_ids[-1] == stop_id and r.stop_reason == stop_id
    for a, b in zip(ours, theirs):
        assert len(a.logprobs) == len(a.token_ids)
        for token, entry in zip(a.token_ids, a.logprobs):
            assert entry[0][0] == token and entry[0][2] == 1  # greedy: the chosen token ranks first
            assert [t for t, _, _ in entry[1:]] and entry[1][1] >= entry[2][1]  # top-2, most likely first
        assert a.cumulative_logprob == pytest.approx(sum(e[0][1] for e in a.logprobs))
        flat = [x for e in a.logprobs for _, x, _ in e]
        assert flat == pytest.approx([x for e in b.logprobs for _, x, _ in e], abs=1e-4)
    plain.close()
    spec.close()


# ---------------------------------------------------------------- sampled exactness (verify.py's pattern)

N = 12_000
PASS_P, FAIL_P = 1e-3, 1e-6
VOCAB = 6
PROMPT = [5]
PENALTIES = (0.8, 0.6, 2.0)  # presence, frequency, repetition
# the target's raw logits by absolute position, and the draft's distributions (it over-proposes repeats)
T_LOGITS = torch.tensor([[2.0, 1.5, 0.5, 0.0, -0.5, 1.0], [1.8, 1.6, 0.2, 0.4, 0.0, 0.9],
                         [0.5, 0.5, 1.0, 1.0, 0.2, 0.1], [0.0, 0.3, 0.6, 0.9, 1.2, 1.5],
                         [1.0, 0.0, 1.0, 0.0, 1.0, 0.0], [0.2, 0.4, 0.6, 0.8, 1.0, 1.2]])  # [positions, vocab]
P_TABLE = torch.tensor([[0.5, 0.3, 0.05, 0.05, 0.05, 0.05], [0.45, 0.35, 0.05, 0.05, 0.05, 0.05],
                        [0.2, 0.2, 0.2, 0.2, 0.1, 0.1], [0.3, 0.3, 0.1, 0.1, 0.1, 0.1],
                        [0.1, 0.1, 0.2, 0.2, 0.2, 0.2]])  # [positions, vocab] (a draft position is at most 4)


def penalised_reference(logits: torch.Tensor, history: list[int]) -> torch.Tensor:
    """The target's distribution at one position, written out from the formulas (not logits_process.py)."""
    presence, frequency, repetition = PENALTIES
    out = logits.clone()
    for t in range(VOCAB):
        count = history.count(t)
        if count or t in PROMPT:
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
        out[t] -= frequency * count + presence * (count > 0)
    return torch.softmax(out, dim=-1)


@pytest.fixture(params=[False, True], ids=["correct", "committed_history_only"])
def broken(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    if request.param:
        committed_only = lp.history_counts
        monkeypatch.setattr(lp, "history_counts", lambda out, drafts, n, v: committed_only(out, drafts[:0], n, v))
    return request.param


@pytest.mark.parametrize("k", [2])
def test_penalised_sampling_follows_processed_target_jointly(k: int, broken: bool) -> None:
    """Rows decode with drafts from P_TABLE against the penalised target; the first two tokens must follow
    Q'_0(x) Q'_1(y | x), each position penalised by the tokens before it."""
    g = torch.Generator().manual_seed(424)
    rows = [Request(i, list(PROMPT), 10, frozenset(), penalties=PENALTIES) for i in range(N)]
    for _ in range(2):  # every call emits >= 1 token per row
        count = torch.tensor([len(r.output) for r in rows])  # [N]
        positions = count[:, None] + torch.arange(k + 1)  # [N, k + 1]
        p = P_TABLE[positions[:, :k]]  # [N, k, vocab]
        drafts = sample(p.reshape(-1, VOCAB), g).reshape(N, k)  # [N, k]
        logits = lp.process_rows(rows, T_LOGITS[positions], drafts)  # [N, k + 1, vocab]
        result = verify_sampling(drafts, p, torch.softmax(logits, dim=-1), g)
        for r, n, tokens in zip(rows, result.num_accepted.tolist(), result.tokens.tolist()):
            r.commit(tokens[: n + 1])
    assert all(len(r.output) >= 2 for r in rows)
    joint = torch.tensor([r.output[0] * VOCAB + r.output[1] for r in rows])  # [N]
    q0 = penalised_reference(T_LOGITS[0], [])
    expected = torch.cat([q0[x] * penalised_reference(T_LOGITS[1], [x]) for x in range(VOCAB)])  # [vocab^2]
    observed = torch.bincount(joint, minlength=VOCAB * VOCAB).double()
    expected = expected.double() / expected.double().sum() * N
    pvalue = float(chisquare(observed.numpy(), expected.numpy()).pvalue)
    if broken:
        assert pvalue < FAIL_P, f"processing without the drafts not detected (p-value {pvalue:.3g})"
    else:
        assert pvalue > PASS_P, f"emitted tokens do not follow the penalised target (p-value {pvalue:.3g})"
