"""Continuous batching in the offloaded pipeline (runtime/offload/batches.py): finished rows' slots are refilled at
once, prompts may be fed in chunks across passes, and every row comes out as it would alone: greedy equal to the
resident engine, sampled rows equal whatever the batch size, refill, chunking or runner (per-request streams)."""

from __future__ import annotations

import pytest

from specoffload.runtime.config import ConfigError, EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.sampling import SamplingParams
from tests.conftest import OFFLOAD_PROMPTS

PROMPTS = OFFLOAD_PROMPTS
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)  # as conftest's resident_greedy
#: rows of very different lengths: a wave waits for its longest, refill does not
UNEVEN = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in (2, 12, 3, 12, 2, 12, 3)]
HOT = SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)


def _offloaded(tiny_models, target: str = "llama", draft: str | None = "qwen2_draft", **kw) -> Engine:
    drafter = draft if draft in (None, "self") else tiny_models[draft]
    base = dict(target=tiny_models[target], draft=drafter, max_batch_size=2,
                max_seq_len=48, num_draft_tokens=2 if draft else 0, device_memory="1GiB", replan_interval=0)
    return Engine(EngineConfig(**(base | kw)))


@pytest.mark.parametrize(("target", "draft", "extra"), [
    ("llama", None, {}),
    ("llama", "qwen2_draft", {}),
    ("llama", "qwen2_draft", {"interleave": False}),
    ("mixtral", "self", {"drafter_options": {"resident_experts": 2}}),
], ids=["nodraft", "draft", "one-batch", "self-draft"])
@pytest.mark.parametrize("chunk", [None, 2], ids=["whole", "chunked"])
def test_refill_and_chunked_prefill_keep_greedy_tokens(tiny_models, single_thread, resident_greedy, target, draft,
                                                       extra, chunk):
    engine = _offloaded(tiny_models, target, draft, prefill_chunk=chunk, **extra)
    out = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in out] == resident_greedy(target)
    batches = engine.pipeline.batches
    assert batches.refilled > 0  # 7 prompts, 2 rows per batch: slots were refilled while other rows ran
    if draft is not None:
        assert engine.last_stats.num_drafted > 0
    engine.close()


def test_refill_takes_fewer_passes_than_waves_on_uneven_rows(tiny_models, single_thread):
    """Rows of 2-3 and 12 tokens: a wave runs as long as its longest row, refill puts a new row in a short one's
    slot at once. Same tokens either way."""
    runs = {}
    for refill in (False, True):
        engine = _offloaded(tiny_models, draft=None, refill=refill)
        tokens = [r.token_ids for r in engine.generate(PROMPTS, UNEVEN)]
        runs[refill] = (tokens, engine.last_stats.passes, engine.pipeline.batches.refilled)
        engine.close()
    assert runs[True][0] == runs[False][0] and [len(t) for t in runs[True][0]] == [2, 12, 3, 12, 2, 12, 3]
    assert runs[False][2] == 0 and runs[True][2] > 0
    # waves: 4 waves of 2 rows (the last of 1): 12 + 12 + 12 + 3 passes, + 1 prefill each; refill: fewer
    assert runs[True][1] < runs[False][1]


def test_chunked_prefill_spreads_a_long_prompt_over_passes(tiny_models, single_thread):
    """A 30-token prompt takes a finished row's slot beside a decoding row. The planner's budget (`PromptBudget.pace`,
    4 or 1 prompt tokens a pass) feeds it in chunks while the other row decodes and the rest whole once that row has
    finished; the batch's first fill decodes no row and is fed whole. The user's cap (`prefill_chunk`) holds on every
    pass. Tokens equal the unchunked run's."""
    from specoffload.runtime.offload.batches import PromptBudget

    prompts = [[1, 7, 9], [1, 4], [1, *range(20, 49)]]
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in (2, 8, 6)]
    out = {}
    for kind, chunk in (("none", None), ("pace", 4), ("pace", 1), ("cap", 4)):
        engine = _offloaded(tiny_models, draft=None, max_batch_size=2, prefill_chunk=chunk if kind == "cap" else None)
        if kind == "pace":
            engine.pipeline.prompts = PromptBudget(pace=chunk)
        fed: list[list[int]] = []
        plan_feed = engine.pipeline._plan_feed

        def spy(b, plan_feed=plan_feed, fed=fed):  # noqa: ANN001, ANN202
            had = b.feed is not None
            plan_feed(b)
            if not had:
                fed.append(list(b.feed))

        engine.pipeline._plan_feed = spy
        out[kind, chunk] = ([r.token_ids for r in engine.generate(prompts, params)], engine.last_stats.passes, fed)
        engine.close()
    tokens, passes, fed = ({key: run[i] for key, run in out.items()} for i in range(3))
    assert all(t == tokens["none", None] for t in tokens.values())
    assert [len(t) for t in tokens["none", None]] == [2, 8, 6]
    assert fed["none", None][2] == [30, 1]  # the long prompt takes the first row's slot at pass 3, whole
    assert fed["pace", 4][0] == fed["pace", 1][0] == [3, 2]  # the first fill: both prompts whole, beyond the budget
    # 4 (1) tokens a pass beside the decoding row until that row finishes, then the rest whole
    assert fed["pace", 4][2:9] == [[4, 1]] * 6 + [[6]] and fed["pace", 1][2:9] == [[1, 1]] * 6 + [[24]]
    assert passes["pace", 4] >= passes["none", None] + 5
    # the user's cap: every pass feeds at most 4 prompt tokens (plus a decoding row's one), the first fill included
    assert fed["cap", 4][0] == [3, 1] and all(sum(f) <= 4 + len(f) - 1 for f in fed["cap", 4])
    assert passes["cap", 4] > passes["pace", 4]


def test_sampled_rows_do_not_depend_on_the_batch(tiny_models, single_thread):
    """Per-request randomness: at the same drafter and k, a sampled row is the same whatever the batch size, the
    refill, the prefill chunking, or the runner (resident or offloaded)."""
    runs = {}
    for rows in (1, 3):
        for refill in (True, False):
            engine = _offloaded(tiny_models, max_batch_size=rows, refill=refill, prefill_chunk=2 if refill else None)
            runs[("offloaded", rows, refill)] = [r.token_ids for r in engine.generate(PROMPTS, HOT)]
            engine.close()
    for rows in (1, 4):
        engine = Engine(EngineConfig(tiny_models["llama"], draft=tiny_models["qwen2_draft"], num_draft_tokens=2,
                                     max_batch_size=rows, max_seq_len=48))
        runs[("resident", rows, True)] = [r.token_ids for r in engine.generate(PROMPTS, HOT)]
    first = next(iter(runs.values()))
    assert all(len(t) == 9 for t in first)
    assert all(tokens == first for tokens in runs.values()), {k: v[:2] for k, v in runs.items()}
    # and a row's key is its identity: the same prompt at another key draws another sample
    engine = Engine(EngineConfig(tiny_models["llama"], max_batch_size=2, max_seq_len=48))
    a, b = engine.generate([PROMPTS[0], PROMPTS[0]], HOT)
    assert a.token_ids != b.token_ids


def test_config_checks_the_continuous_batching_fields(tiny_models):
    with pytest.raises(ConfigError, match="prefill_chunk"):
        EngineConfig(tiny_models["llama"], prefill_chunk=0)
    with pytest.raises(ConfigError, match="refill"):
        EngineConfig(tiny_models["llama"], refill="yes")


@pytest.mark.parametrize("offloaded", [True, False], ids=["offloaded", "resident"])
def test_generate_iter_streams_rows_as_they_finish(tiny_models, single_thread, offloaded):
    """Results come as rows finish, from prompts read lazily as slots free up; the same rows as `generate`."""
    engine = (_offloaded(tiny_models) if offloaded else
              Engine(EngineConfig(tiny_models["llama"], draft=tiny_models["qwen2_draft"], num_draft_tokens=2,
                                  max_batch_size=2, max_seq_len=48)))
    reference = engine.generate(PROMPTS, UNEVEN)
    pulled: list[int] = []

    def prompts():
        for i, prompt in enumerate(PROMPTS):
            pulled.append(i)
            yield prompt

    seen_at_first: list[int] = []
    out = []
    for result in engine.generate_iter(prompts(), iter(UNEVEN)):
        if not out:
            seen_at_first.append(len(pulled))
        out.append(result)
    assert sorted(r.index for r in out) == list(range(len(PROMPTS)))
    assert {r.index: r.token_ids for r in out} == {r.index: r.token_ids for r in reference}
    assert [r.index for r in out] != list(range(len(PROMPTS)))  # finish order: short rows first
    assert seen_at_first[0] < len(PROMPTS)  # the first result came before every prompt was read
    assert engine.last_stats is not None and engine.last_stats.num_prompts == len(PROMPTS)
    engine.close()


def test_a_job_streams_every_chunk_through_one_pipeline(tiny_models, single_thread):
    """The local backend feeds a job's chunks to one engine stream: rows of the next chunk take slots while the
    last chunk's rows still run (a chunk is the unit of writing, never a drain point), and each row equals its
    own `generate` (same key: its index in the input)."""
    from specoffload.runtime.backends import BackendOptions, LocalBackend
    from specoffload.runtime.offline.chunks import chunked
    from specoffload.runtime.offline.rows import RowJob, RowRequest

    config = EngineConfig(tiny_models["llama"], draft=tiny_models["qwen2_draft"], num_draft_tokens=2,
                          device_memory="1GiB", max_batch_size=2, max_seq_len=48, replan_interval=0)
    backend = LocalBackend(config, BackendOptions(progress=False))
    streams = []
    real_stream = backend.engine.pipeline.stream
    backend.engine.pipeline.stream = lambda *a, **kw: (streams.append(1), real_stream(*a, **kw))[1]
    jobs = [RowJob(RowRequest(i, i + 1), tuple(p), HOT if i % 2 else UNEVEN[i]) for i, p in enumerate(PROMPTS)]
    done = list(backend.run(chunked(iter(jobs), 2), window=1))
    assert len(streams) == 1 and sorted(d.chunk.number for d in done) == [0, 1, 2, 3]
    got = {j.index: r.token_ids for d in done for j, r in zip(d.chunk.jobs, d.results)}
    ref = backend.engine.generate(PROMPTS, [j.params for j in jobs], keys=[j.index for j in jobs])
    assert got == {r.index: tuple(r.token_ids) for r in ref}
    backend.close()


def test_bench_refill_ideal_passes_on_literal_lengths():
    """Waves last their longest row (12 + 12 passes); refill puts the next prompt in the first free slot."""
    from scripts.bench_refill import ideal_passes

    assert ideal_passes([2, 12, 3, 12], 2) == (24, 17)
    assert ideal_passes([5, 5, 5, 5], 2) == (10, 10)  # equal rows: nothing to gain
    assert ideal_passes([7], 4) == (7, 7)
