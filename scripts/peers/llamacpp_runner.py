"""Run llama.cpp (llama-cpp-python) on token-id prompts, in the peer's own venv (scripts/setup_llamacpp.sh).

Reads a JSON request on stdin: {"model": GGUF path, "prompts": [[ids]], "new_tokens": N, "threads": T,
"n_ctx": C}; each prompt is evaluated from an empty context (one sequence at a time: llama-cpp-python's high-level
API), then N greedy tokens (the argmax of the last token's logits, read from the context as llama.cpp's own
greedy sampler does; EOS not special), each evaluated in turn. Writes
{"tokens": [[ids]], "prefill_s": [...], "decode_s": [...], "version": ...} to stdout.
"""

import json
import sys
import time

import llama_cpp
import numpy as np


def main() -> None:
    req = json.load(sys.stdin)
    llm = llama_cpp.Llama(model_path=req["model"], n_ctx=req["n_ctx"], n_threads=req["threads"],
                          n_threads_batch=req["threads"], n_batch=512, verbose=False)
    out = {"tokens": [], "prefill_s": [], "decode_s": [], "version": llama_cpp.__version__}
    for ids in req["prompts"]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        new = []
        for i in range(req["new_tokens"]):
            logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))  # the last token's
            tok = int(np.argmax(logits))
            new.append(tok)
            if i + 1 < req["new_tokens"]:
                llm.eval([tok])
        t2 = time.perf_counter()
        out["tokens"].append(new)
        out["prefill_s"].append(t1 - t0)
        out["decode_s"].append(t2 - t1)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
