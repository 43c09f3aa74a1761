"""No sampling value can end a job or corrupt its output (issue 39, case 1 and 6).

Every value a SamplingParams accepts gives finite probabilities through the logit processing and the warp (a
hypothesis property over extreme values of every field), and every value it refuses is one ValueError naming the
field. The engine runs rows of extreme values side by side, greedy and sampled, resident and offloaded, with finite
logprobs; a batch row out of range is an error row, never the end of the job.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specoffload.runtime import Engine, EngineConfig, SamplingParams
from specoffload.runtime.engine import PromptError
from specoffload.runtime.logits_process import process_row
from specoffload.runtime.offline.openai import OpenAIBatchFormat
from specoffload.runtime.offline.source import RawRow
from specoffload.runtime.param_ranges import MAX_N, RANGES, SAMPLING_EPS
from specoffload.runtime.request import Request
from specoffload.runtime.sampling import warp_logits

_EXTREME_FLOATS = st.one_of(
    st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e-38, 1e-6, SAMPLING_EPS, 1e-4, 0.01, 1.0, 2.0, 100.0, 1e30,
                     1.7e308, -1e-300, -2.0, -3.0, math.inf, -math.inf, math.nan]),
    st.floats(allow_nan=True, allow_infinity=True),
)
_EXTREME_INTS = st.sampled_from([-(2**64), -2, -1, 0, 1, 2, 7, 16, 17, 2**31 - 1, 2**31, 2**63, 2**64])
_ODD = st.sampled_from([None, True, False, 2.5, "3", [1], float("nan")])


@settings(max_examples=300, deadline=None)
@given(temperature=_EXTREME_FLOATS, top_p=_EXTREME_FLOATS, top_k=st.one_of(_EXTREME_INTS, _ODD),
       presence=_EXTREME_FLOATS, frequency=_EXTREME_FLOATS, repetition=_EXTREME_FLOATS,
       n=st.one_of(_EXTREME_INTS, _ODD), logprobs=st.one_of(_EXTREME_INTS, _ODD),
       scale=st.sampled_from([1.0, 30.0, 1e4, 1e30]), seed=st.integers(0, 2**16))
def test_any_accepted_value_gives_finite_probabilities(temperature, top_p, top_k, presence, frequency, repetition,
                                                       n, logprobs, scale, seed) -> None:
    try:
        p = SamplingParams(max_tokens=4, temperature=temperature, top_p=top_p, top_k=top_k, presence_penalty=presence,
                           frequency_penalty=frequency, repetition_penalty=repetition, n=n, logprobs=logprobs)
    except ValueError as err:  # refused: one message naming a field, never a TypeError / OverflowError
        assert any(f"'{name}'" in str(err) or str(err).startswith(name) for name in RANGES), str(err)
        return
    assert p.temperature == 0 or p.temperature >= SAMPLING_EPS
    g = torch.Generator().manual_seed(seed)
    vocab = 64
    logits = torch.randn(3, vocab, generator=g) * scale  # [positions, vocab]
    row = Request(0, [1, 5, 9], 4, frozenset({2}), warp=p.warp, min_tokens=2,
                  penalties=(p.presence_penalty, p.frequency_penalty, p.repetition_penalty), output=[5, 7, 7])
    processed = process_row(logits, row, torch.tensor([7, 9]), vocab)  # [positions, vocab]
    assert not processed.isnan().any() and not (processed == math.inf).any()
    probs = warp_logits(processed, *p.warp)  # [positions, vocab]
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    torch.multinomial(probs, 1, generator=g)  # what a sampled row does with them: no error


def test_python_api_ranges_and_types() -> None:
    """The batch reader's ranges hold for Python callers too: n, logprobs and the penalties are checked with their
    types, in one message naming the field."""
    for bad, field in ((dict(n=10**9), "'n'"), (dict(n=2.5), "'n'"), (dict(n=MAX_N + 1), "'n'"),
                       (dict(logprobs=True), "'logprobs'"), (dict(logprobs=-1), "'logprobs'"),
                       (dict(repetition_penalty=1e-300), "'repetition_penalty'"),
                       (dict(repetition_penalty=1e300), "'repetition_penalty'"), (dict(top_k="3"), "'top_k'"),
                       (dict(presence_penalty="x"), "'presence_penalty'"), (dict(min_tokens=1.5), "'min_tokens'"),
                       (dict(stop_token_ids=[1.5]), "stop_token_ids"), (dict(stop_token_ids=3), "stop_token_ids"),
                       (dict(ignore_eos="yes"), "ignore_eos")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)
    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy


def test_batch_rows_out_of_range_are_error_rows() -> None:
    import json

    from specoffload.runtime.offline.rows import RowError

    def parse(**body):  # noqa: ANN003, ANN202
        line = json.dumps({"custom_id": "r", "method": "POST", "url": "/v1/completions",
                           "body": {"prompt": "x", **body}})
        return OpenAIBatchFormat().parse(RawRow(0, 1, line.encode()))

    assert parse(temperature=1e-300).overrides["temperature"] == 1e-300  # accepted: greedy once it runs
    for body in (dict(repetition_penalty=1e-300), dict(repetition_penalty=1e6), dict(n=10**9)):
        row = parse(**body)
        assert isinstance(row, RowError) and row.code == "invalid_parameter" and next(iter(body)) in row.message


EXTREMES = [
    SamplingParams(max_tokens=6, ignore_eos=True, temperature=1e-300, logprobs=3),
    SamplingParams(max_tokens=6, ignore_eos=True, temperature=1e-300, repetition_penalty=0.01, logprobs=2),
    SamplingParams(max_tokens=6, ignore_eos=True, temperature=1e-4, seed=1, logprobs=1),
    SamplingParams(max_tokens=6, ignore_eos=True, temperature=1e30, seed=2, top_p=5e-324, logprobs=20),
    SamplingParams(max_tokens=6, ignore_eos=True, temperature=2.0, seed=3, repetition_penalty=100.0, top_k=1,
                   presence_penalty=2.0, frequency_penalty=-2.0, min_tokens=6, logprobs=0),
    SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.7, seed=4, repetition_penalty=0.01,
                   presence_penalty=-2.0, frequency_penalty=2.0, top_k=2**31 - 1),
]


@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded"])
def test_extreme_rows_run_side_by_side(tiny_models, single_thread, offloaded) -> None:
    """Rows of extreme values in one batch, with a draft: every row completes, every logprob is finite, and the
    rows with a temperature below the floor are the greedy rows."""
    extra = dict(device_memory="2MiB", max_seq_len=40, max_batch_size=3) if offloaded else dict(max_batch_size=3)
    engine = Engine(EngineConfig(tiny_models["llama"], draft=tiny_models["llama"], num_draft_tokens=3, **extra))
    prompts = [[1, 5 + i, 9, 33] for i in range(len(EXTREMES))]
    results = engine.generate(prompts, EXTREMES)
    greedy = engine.generate(prompts[:2], [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                          repetition_penalty=0.01)])
    assert [r.token_ids for r in results[:2]] == [r.token_ids for r in greedy]
    for r, p in zip(results, EXTREMES):
        assert len(r.token_ids) == 6 and all(0 <= t < 512 for t in r.token_ids)
        if p.logprobs is not None:
            values = [lp for entry in r.logprobs for _t, lp, _rank in entry]
            assert len(r.logprobs) == 6 and all(math.isfinite(v) for v in values), values
    with pytest.raises(PromptError, match="request 0: logprobs = 21 is more than max_logprobs = 20"):
        engine.generate([[1, 5]], SamplingParams(temperature=0.0, max_tokens=2, logprobs=21))
    engine.close()
