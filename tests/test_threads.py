"""One `LLM` or `Engine` shared by threads (issue 39, case 3): calls are serialised, never interleaved, so every
thread gets the rows a call alone would give; a call on the thread whose iterator is still open is refused with
one clear error.
"""

from __future__ import annotations

import threading

import pytest

from specoffload.runtime import LLM, Engine, EngineBusyError, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[[1, 5 + t, 9 + i, 33][: 2 + (t + i) % 3] for i in range(5)] for t in range(4)]  # one list per thread


def _in_threads(call) -> list:  # noqa: ANN001
    """call(t) on thread t for every prompt list at once; the results by thread (an exception re-raised)."""
    out: list = [None] * len(PROMPTS)
    start = threading.Barrier(len(PROMPTS))

    def run(t: int) -> None:
        start.wait()
        try:
            out[t] = call(t)
        except BaseException as err:  # noqa: BLE001 - handed back to the test
            out[t] = err

    threads = [threading.Thread(target=run, args=(t,)) for t in range(len(PROMPTS))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    for value in out:
        if isinstance(value, BaseException):
            raise value
    return out


CASES = {
    "resident-none": dict(),
    "resident-model": dict(draft="qwen2_draft", num_draft_tokens=3),
    "resident-suffix": dict(drafter="suffix", num_draft_tokens=3),
    "offloaded-model": dict(device_memory="1GiB", max_batch_size=2, draft="qwen2_draft", num_draft_tokens=3,
                            max_seq_len=40),
    "offloaded-self": dict(device_memory="1GiB", max_batch_size=2, drafter="self", num_draft_tokens=3,
                           max_seq_len=40),
}


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("case", list(CASES))
def test_threads_share_one_llm_and_engine(tiny_models, case) -> None:
    options = dict(CASES[case])
    if "draft" in options:
        options["draft"] = tiny_models[options["draft"]]
    llm = LLM(tiny_models["qwen2_moe"], dtype="float32", **options)
    alone = [[o.outputs[0].token_ids for o in llm.generate(p, PARAMS)] for p in PROMPTS]
    got = _in_threads(lambda t: [o.outputs[0].token_ids for o in llm.generate(PROMPTS[t], PARAMS)])
    assert got == alone
    streamed = _in_threads(lambda t: sorted((o.prompt_token_ids, o.outputs[0].token_ids)
                                            for o in llm.generate_iter(PROMPTS[t], PARAMS)))
    assert streamed == [sorted(zip(p, a)) for p, a in zip(PROMPTS, alone)]
    engine: Engine = llm.engine  # the engine itself, shared directly
    got = _in_threads(lambda t: [r.token_ids for r in engine.generate(PROMPTS[t], PARAMS)])
    assert got == alone
    llm.shutdown()


def test_a_call_while_this_threads_iterator_is_open_is_refused(tiny_models) -> None:
    llm = LLM(tiny_models["llama"], dtype="float32", max_num_seqs=2)
    it = llm.generate_iter(PROMPTS[0], PARAMS)
    first = next(it)
    with pytest.raises(EngineBusyError, match="LLM.generate: this thread's LLM.generate_iter is still open"):
        llm.generate(PROMPTS[1], PARAMS)
    inner = llm.engine.generate_iter(PROMPTS[1], PARAMS)
    with pytest.raises(EngineBusyError, match="Engine.stream: this thread's Engine.stream is still open"):
        next(inner)
    rest = list(it)
    assert len(rest) + 1 == len(PROMPTS[0]) and first.finished
    assert len(llm.generate(PROMPTS[1], PARAMS)) == len(PROMPTS[1])  # exhausted: the turn is free again
    it = llm.generate_iter(PROMPTS[0], PARAMS)
    next(it)
    it.close()  # closed early: free as well
    assert len(llm.engine.generate(PROMPTS[1], PARAMS)) == len(PROMPTS[1])
    llm.shutdown()
