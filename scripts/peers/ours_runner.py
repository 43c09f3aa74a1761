"""Run our engine on token-id prompts in a process of its own (so that a memory limit can be put on it: the peers
bench's budget case, scripts/bench_peers.py `--budget`).

Reads a JSON request on stdin: {"model": path, "prompts": [[ids]], "new_tokens": N, "batch": B,
"device_memory": bytes or null, "packed_weights": "auto" / "on" / "off"}; greedy, EOS ignored, no draft. Runs
generate twice, for 1 and for N new tokens (decode rate = the tokens after the first over T(N) - T(1), as
bench_peers times ours in process), and writes {"tokens": [[ids]], "total_s": ..., "first_token_s": ...,
"bytes_read": ..., "max_rss_bytes": ...} to stdout.
"""

import json
import resource
import sys
import time

from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.sampling import SamplingParams


def main() -> None:
    req = json.load(sys.stdin)
    longest = max(map(len, req["prompts"]))
    engine = Engine(EngineConfig(target=req["model"], dtype="bfloat16", max_batch_size=req["batch"],
                                 num_draft_tokens=0, device_memory=req.get("device_memory"),
                                 packed_weights=req.get("packed_weights", "auto"),
                                 max_seq_len=longest + req["new_tokens"] + 8))
    try:
        times, results, read = {}, [], 0
        for n in (1, req["new_tokens"]):
            params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
            start = time.perf_counter()
            results = engine.generate(req["prompts"], params)
            times[n] = time.perf_counter() - start
            read = engine.last_stats.bytes_read
    finally:
        engine.close()
    json.dump({"tokens": [r.token_ids for r in results], "total_s": times[req["new_tokens"]], "first_token_s": times[1],
               "bytes_read": read, "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024},
              sys.stdout)


if __name__ == "__main__":
    main()
