"""Run our engine on token-id prompts in a process of its own (so that a memory limit can be put on it: the peers
bench's budget case, scripts/bench_peers.py `--budget`), run from the repository root as
`python -m scripts.peers.ours_runner`.

Reads a JSON request on stdin: {"model": path, "prompts": [[ids]], "new_tokens": N, "batch": B,
"device_memory": bytes or null, "packed_weights": "auto" / "on" / "off", "prefill_chunk": tokens or null,
"dtype": the compute dtype (default "bfloat16"), "drafter": a drafter's name (default "none"), "k": its draft tokens
per row per pass}; greedy, EOS ignored. Runs generate twice, for 1 and for N new tokens (decode rate = the tokens
after the first over T(N) - T(1), as bench_peers times ours in process), and writes {"tokens": [[ids]], "total_s": ...,
"first_token_s": ..., "bytes_read": ..., "max_rss_bytes": ..., "passes": ..., and where its time went in the N-token
call: "load_s" (the loader's busy seconds), "read_s" (of it, reading the file), "decompress_s" (of it, turning
stored blocks into the kernels' layouts), "compute_s" (the pass's compute spans: scripts/common.py
`io_compute_seconds`), and with a drafter "acceptance" (accepted over drafted tokens)} to stdout.
"""

import json
import resource
import sys
import time

from scripts.common import io_compute_seconds
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.sampling import SamplingParams


def main() -> None:
    req = json.load(sys.stdin)
    longest = max(map(len, req["prompts"]))
    drafter = req.get("drafter", "none")
    engine = Engine(EngineConfig(target=req["model"], dtype=req.get("dtype", "bfloat16"), max_batch_size=req["batch"],
                                 drafter=drafter, num_draft_tokens=req.get("k", 0) if drafter != "none" else 0,
                                 device_memory=req.get("device_memory"),
                                 packed_weights=req.get("packed_weights", "auto"),
                                 prefill_chunk=req.get("prefill_chunk"), trace=True,
                                 max_seq_len=longest + req["new_tokens"] + 8))
    streamer = getattr(getattr(engine.pipeline, "workers", None), "prefetch", None)
    streamer = getattr(streamer, "streamer", None)  # the local backend's loader (None: nothing streams)
    try:
        times, results, where = {}, [], {}
        for n in (1, req["new_tokens"]):
            params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
            before = (streamer.read_seconds, streamer.decompress_seconds) if streamer is not None else (0.0, 0.0)
            start = time.perf_counter()
            results = engine.generate(req["prompts"], params)
            times[n] = time.perf_counter() - start
            load, compute = io_compute_seconds(engine)
            after = (streamer.read_seconds, streamer.decompress_seconds) if streamer is not None else (0.0, 0.0)
            stats = engine.last_stats
            where = {"bytes_read": stats.bytes_read, "passes": stats.passes, "load_s": load,
                     "read_s": after[0] - before[0], "decompress_s": after[1] - before[1], "compute_s": compute,
                     "acceptance": stats.acceptance_rate if stats.num_drafted else None}
    finally:
        engine.close()
    json.dump({"tokens": [r.token_ids for r in results], "total_s": times[req["new_tokens"]], "first_token_s": times[1],
               "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, **where}, sys.stdout)


if __name__ == "__main__":
    main()
