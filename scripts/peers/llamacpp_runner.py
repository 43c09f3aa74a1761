"""Run llama.cpp (llama-cpp-python) on token-id prompts, in the peer's own venv (scripts/setup_llamacpp.sh).

Reads a JSON request on stdin: {"model": GGUF path, "prompts": [[ids]], "new_tokens": N, "threads": T, "n_ctx": C,
"batch": B, "repack": R, "ubatch": U}. B = 1: each prompt is evaluated from an empty context (one sequence at a time:
llama-cpp-python's high-level API), then N greedy tokens (the argmax of the last token's logits, read from the context
as llama.cpp's own greedy sampler does; EOS not special), each evaluated in turn. B > 1: llama.cpp's low-level batch
API, as its `batched` example does: the prompts in waves of B sequences, each wave's prompts decoded in one batch (a
sequence id each, logits at each prompt's last token), then N - 1 steps of one batch of B tokens (one per sequence, at
its own position); R false (B > 1 only) keeps the weights mmap'd as stored instead of repacked into llama.cpp's faster
CPU layouts in heap memory (its `--no-repack`: how it runs a model larger than RAM); U (B > 1 only; absent or 0: the
wave's whole prefill) is llama.cpp's n_ubatch, the tokens of one compute step within a decode call. Writes {"tokens":
[[ids]], "prefill_s": [...], "decode_s": [...], "version": ...} to stdout (one prefill / decode time per prompt, or
per wave).
"""

import json
import sys
import time

import llama_cpp
import numpy as np


def batched(req: dict) -> dict:
    """The prompts in waves of req["batch"] sequences through llama_batch / llama_decode (module docstring)."""
    L = llama_cpp
    width = req["batch"]
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    mparams.use_extra_bufts = req.get("repack", True)  # False: the weights stay mmap'd as stored (`--no-repack`)
    model = L.llama_model_load_from_file(req["model"].encode(), mparams)
    longest = max(map(len, req["prompts"]))
    cparams = L.llama_context_default_params()
    cparams.n_ctx = width * req["n_ctx"]
    cparams.n_batch = max(512, width * longest)  # a wave's prompts in one llama_decode
    cparams.n_ubatch = req.get("ubatch") or cparams.n_batch  # tokens per compute step (llama.cpp's default: 512)
    cparams.n_seq_max = width
    cparams.n_threads = cparams.n_threads_batch = req["threads"]
    ctx = L.llama_init_from_model(model, cparams)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(width * longest, 0, width)
    out = {"tokens": [], "prefill_s": [], "decode_s": [], "version": llama_cpp.__version__}

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, wants logits)
        batch.n_tokens = len(entries)
        for i, (tok, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(i: int) -> int:
        return int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))

    try:
        for start in range(0, len(req["prompts"]), width):
            wave = req["prompts"][start:start + width]
            L.llama_memory_clear(L.llama_get_memory(ctx), True)
            t0 = time.perf_counter()
            entries = [(tok, pos, seq, pos == len(ids) - 1) for seq, ids in enumerate(wave)
                       for pos, tok in enumerate(ids)]
            decode(entries)
            last = [i for i, e in enumerate(entries) if e[3]]  # each sequence's logits row, in sequence order
            new = [[argmax(i)] for i in last]
            t1 = time.perf_counter()
            for step in range(1, req["new_tokens"]):
                decode([(row[-1], len(ids) + step - 1, seq, True) for seq, (ids, row) in enumerate(zip(wave, new))])
                for seq, row in enumerate(new):
                    row.append(argmax(seq))
            t2 = time.perf_counter()
            out["tokens"] += new
            out["prefill_s"].append(t1 - t0)
            out["decode_s"].append(t2 - t1)
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    return out


def main() -> None:
    req = json.load(sys.stdin)
    if req.get("batch", 1) > 1:
        json.dump(batched(req), sys.stdout)
        return
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
