"""Scaling experiment for offline jobs on Ray replicas (issue 12): does a second node double the throughput, and
does a job survive losing a node?

On this machine: a real multi-node Ray cluster (scripts/local_cluster.py: a head and two worker nodes, each started
with `ray start`, its own raylet, num-cpus 1, token authentication on). Each worker node is pinned to one core, so
each replica (its five actors inherit the raylet's affinity) computes on one core. The real pair
(Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft), bfloat16 under a budget that keeps every weight resident: the
nodes share one disk here, so streaming replicas would measure the disk, not the replicas. The corpus: HumanEval
prompts (cut to --prompt-tokens tokens) as an OpenAI batch file of /v1/completions requests, greedy, EOS ignored.
Every run is `ray job submit -- specoffload generate --backend ray ...`, as a user would run it.

  1. one replica on one node, 2. two replicas on two nodes: scaling_2 = tokens/s (2) / tokens/s (1), over the
     generation phase (after the replicas started, until the last row is written);
  3. two replicas, and one worker node's raylet SIGKILLed after the first chunk is written: rows lost and duplicated
     (custom_ids of the output against the input), the job's status, the rows equal to run 2's, and the time to
     recover (kill -> lease lost, kill -> the lost chunk done on the other replica), with Ray's default health checks.

Past two nodes this machine has no cores to give: the throughput for N nodes is *projected* from the measured
per-replica engine time per chunk, the per-chunk round trip (lease to result, minus engine time) and the driver's
serial time per chunk (handing out, taking in and writing a chunk): X(N) = min(N * T / (e + o), T / d) tokens/s for T
tokens per chunk. Results: docs/perf/scaling.json ("summary"), docs/perf/scaling.png, docs/perf/README.md.

    flock /tmp/specoffload-bench.lock .venv/bin/python -m scripts.bench_scaling [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import secrets
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

from scripts.common import PERF, figure, utc_now, write_json
from scripts.get_models import model_dir
from scripts.local_cluster import BIN, LocalCluster
from scripts.readme_section import write_section

REPLICA = {"specoffload_replica": 1}


def cpu_times() -> list[tuple[int, int]]:
    """Per core (busy, total) jiffies from /proc/stat: the busy share over a run tells a quiet machine from a shared
    one (two replicas, one core each, should keep both cores near 100% and nothing else should be running)."""
    cores = []
    for line in Path("/proc/stat").read_text().splitlines():
        if re.match(r"cpu\d+ ", line):
            user, nice, system, idle, iowait, *rest = (int(x) for x in line.split()[1:])
            busy = user + nice + system + sum(rest[:3])  # irq, softirq, steal
            cores.append((busy, busy + idle + iowait))
    return cores


def busy_share(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> list[float]:
    return [round((b1 - b0) / max(t1 - t0, 1), 3) for (b0, t0), (b1, t1) in zip(before, after)]


def make_corpus(path: Path, rows: int, prompt_tokens: int, new_tokens: int) -> list[str]:
    """HumanEval prompts (cycled when rows > 164), cut to prompt_tokens tokens, as OpenAI batch requests."""
    from specoffload.runtime.prompts import humaneval_prompts
    from specoffload.runtime.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir("target"))
    prompts = humaneval_prompts()
    ids = []
    with path.open("w") as f:
        for i in range(rows):
            tokens = tokenizer.encode(prompts[i % len(prompts)], add_special_tokens=False)[:prompt_tokens]
            custom_id = f"HumanEval/{i % len(prompts)}#{i // len(prompts)}"
            body = {"prompt": tokens, "max_tokens": new_tokens}
            f.write(json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body})
                    + "\n")
            ids.append(custom_id)
    return ids


class Jobs:
    """`ray job submit` against the cluster, and what a finished job left."""

    def __init__(self, cluster: LocalCluster, work: Path, cli: list[str]) -> None:
        self.cluster, self.work, self.cli = cluster, work, cli
        self.env = {k: v for k, v in cluster.env.items() if k != "RAY_ADDRESS"}

    def submit(self, name: str, replicas: int) -> dict:
        job_id = f"bench-{name}-{secrets.token_hex(3)}"
        out, summary = self.work / f"{name}.jsonl", self.work / f"{name}.summary.json"
        cmd = [str(BIN / "ray"), "job", "submit", f"--address={self.cluster.dashboard}", f"--submission-id={job_id}",
               "--no-wait", "--", str(BIN / "specoffload"), *self.cli, "--replicas", str(replicas), "-o", str(out),
               "--summary", str(summary)]
        load_at_submit, cpu = os.getloadavg()[0], cpu_times()
        subprocess.run(cmd, env=self.env, check=True, capture_output=True, text=True, timeout=120)
        return {"id": job_id, "out": out, "summary": summary, "submitted": time.time(), "cpu": cpu,
                "load_at_submit": load_at_submit}

    def wait(self, job: dict, timeout_s: float = 3600) -> dict:
        deadline = time.monotonic() + timeout_s
        while (record := self.cluster.job(job["id"]))["status"] in ("PENDING", "RUNNING"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job['id']} did not finish in {timeout_s:.0f} s")
            time.sleep(2)
        logs = subprocess.run([str(BIN / "ray"), "job", "logs", f"--address={self.cluster.dashboard}", job["id"]],
                              env=self.env, capture_output=True, text=True, timeout=120).stdout
        summary = json.loads(job["summary"].read_text()) if job["summary"].exists() else {}
        return {"status": record["status"], "wall_s": time.time() - job["submitted"], "summary": summary,
                "load_avg_1min_at_submit": job["load_at_submit"],  # ~0 when nothing else runs here
                "load_avg_1min_at_end": os.getloadavg()[0],  # above 2 on this 2-core machine: someone else computed
                "core_busy_share": busy_share(job["cpu"], cpu_times()),
                "logs": logs[-4000:], "rows": [json.loads(x) for x in job["out"].read_text().splitlines()]}


def chunk_costs(alone: dict, together: dict, tokens_per_chunk: int) -> dict:
    """Per chunk: a replica's engine seconds when it has its node to itself (the one-replica run: on a real cluster
    every node does), and, from the run with several replicas, the round trip (lease to result minus engine) and the
    driver's serial seconds (handing out, taking in and writing a chunk)."""
    def per_chunk(summary: dict, key: str) -> float:
        replicas = summary["backend"]["replicas"]
        return sum(r[key] for r in replicas) / sum(r["chunks"] for r in replicas)

    return {"engine_s_per_chunk": per_chunk(alone, "engine_s"),
            "engine_s_per_chunk_two_on_this_machine": per_chunk(together, "engine_s"),
            "overhead_s_per_chunk": per_chunk(together, "call_s") - per_chunk(together, "engine_s"),
            "driver_s_per_chunk": (together["backend"]["driver_s"] + together["write_s"]) / together["chunks"],
            "tokens_per_chunk": tokens_per_chunk}


def project(costs: dict, nodes: list[int]) -> list[dict]:
    """Steady-state tokens/s for N replicas: N * T / (e + o), at most the driver's T / d."""
    t, e, o, d = (costs["tokens_per_chunk"], costs["engine_s_per_chunk"], costs["overhead_s_per_chunk"],
                  costs["driver_s_per_chunk"])
    return [{"nodes": n, "tokens_per_s": min(n * t / (e + o), t / d if d > 0 else float("inf"))} for n in nodes]


def plot(path: Path, projection: list[dict], measured: dict[int, float]) -> None:
    with figure(path, (6.4, 4.2), dpi=110) as ax:
        ns = [p["nodes"] for p in projection]
        ax.plot(ns, [p["tokens_per_s"] for p in projection], "--", label="projection (model, not measured)")
        ax.plot(ns, [measured[1] * n for n in ns], ":", color="grey", label="linear from 1 replica")
        ax.plot(list(measured), list(measured.values()), "o", color="black", label="measured (this machine)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("nodes (one replica each, one core per replica here)")
        ax.set_ylabel("tokens/s (generation phase)")
        ax.set_title("Offline job throughput vs nodes: PROJECTION beyond 2")
        ax.legend()

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--device-memory", default="6GiB")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (16 rows), not a result")
    parser.add_argument("--out", type=Path, default=PERF / "scaling.json")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.new_tokens, args.chunk_size = 16, 4, 4
    work = Path(tempfile.mkdtemp(prefix="so-scaling-"))
    corpus = work / "humaneval_batch.jsonl"
    ids = make_corpus(corpus, args.rows, args.prompt_tokens, args.new_tokens)
    max_seq_len = args.prompt_tokens + args.new_tokens + args.k + 1
    cli = ["generate", "--backend", "ray", "--target", str(model_dir("target")), "--draft", str(model_dir("draft")),
           "--prompts", str(corpus), "--dtype", "bfloat16", "--device-memory", args.device_memory, "--max-seq-len",
           str(max_seq_len), "--batch-size", str(args.batch_size), "-k", str(args.k), "--threads", "1",
           "--max-new-tokens", str(args.new_tokens),
           "--temperature", "0", "--ignore-eos", "--chunk-size", str(args.chunk_size),
           "--progress-interval", "30"]
    tokens_per_chunk = args.chunk_size * args.new_tokens
    results: dict = {}
    with LocalCluster(head_cpus=1) as cluster:  # Ray's default health checks: the recovery time a user gets
        victim = None
        for core in (0, 1):
            victim = cluster.add_worker(cpus=1, resources=REPLICA, cores={core})
        jobs = Jobs(cluster, work, cli)
        for name, replicas in (("one_replica", 1), ("two_replicas", 2)):
            print(f"[{name}] {args.rows} rows on {replicas} replica(s) ...", flush=True)
            results[name] = jobs.wait(jobs.submit(name, replicas))
            s = results[name]["summary"]
            print(f"[{name}] {results[name]['status']}: {s.get('tokens_per_s', 0):.2f} tokens/s", flush=True)
            if results[name]["status"] != "SUCCEEDED":
                print(results[name]["logs"], flush=True)
        print("[node_lost] two replicas; worker node 2's raylet is killed after the first chunk ...", flush=True)
        job = jobs.submit("node_lost", 2)
        while not job["out"].exists() or job["out"].read_text().count("\n") < args.chunk_size:
            if cluster.job(job["id"])["status"] not in ("PENDING", "RUNNING"):
                break
            time.sleep(0.2)
        killed_at = time.time()
        assert victim is not None
        cluster.kill_raylet(victim)
        results["node_lost"] = lost = jobs.wait(job)
        lost["killed_at"] = killed_at
    rows = {name: r["rows"] for name, r in results.items()}
    counts = Counter(row["custom_id"] for row in rows["node_lost"])
    events = lost["summary"].get("backend", {}).get("events", [])
    first = {e["event"]: e["time"] for e in reversed(events)}  # the first event of each kind
    one, two = results["one_replica"]["summary"], results["two_replicas"]["summary"]
    costs = chunk_costs(one, two, tokens_per_chunk)
    nodes = [1, 2, 4, 8, 16, 32, 64]
    projection = project(costs, nodes)
    measured = {1: one["tokens_per_s"], 2: two["tokens_per_s"]}
    summary = {
        "scaling_2": two["tokens_per_s"] / one["tokens_per_s"],
        "tokens_per_s_1_replica": one["tokens_per_s"],
        "tokens_per_s_2_replicas": two["tokens_per_s"],
        "node_lost": {
            "status": lost["status"],
            "rows_lost": sum(1 for i in ids if counts[i] == 0),
            "rows_duplicated": sum(1 for i in ids if counts[i] > 1),
            "rows_equal_to_no_fault_run": [r["response"]["body"]["choices"] for r in rows["node_lost"]]
            == [r["response"]["body"]["choices"] for r in rows["two_replicas"]],
            "lease_lost_after_s": first["lease_lost"] - killed_at if "lease_lost" in first else None,
            "re_leased_after_s": first["re_leased"] - killed_at if "re_leased" in first else None,
            "recovered_after_s": first["chunk_redone"] - killed_at if "chunk_redone" in first else None,
            "extra_job_s_vs_no_fault": lost["summary"].get("wall_s", 0) - two.get("wall_s", 0),
            "tokens_per_s": lost["summary"].get("tokens_per_s"),
            "job_wall_s": lost["wall_s"],
        },
        "per_chunk": costs,
        "projection_is_a_model": True,
        "projection": projection,
    }
    record = {
        "benchmark": "scaling",
        "run_at": utc_now(),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "setup": {"rows": args.rows, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                  "chunk_size": args.chunk_size, "batch_size": args.batch_size, "k": args.k, "dtype": "bfloat16",
                  "device_memory": args.device_memory, "cluster": "head (num-cpus 1) + 2 worker nodes (num-cpus 1, "
                  "pinned to core 0 and core 1), token auth, Ray default health checks", "quick": args.quick},
        "summary": summary,
        "runs": {name: {k: v for k, v in r.items() if k != "rows"} for name, r in results.items()},
    }
    write_json(args.out, record)
    if args.quick:
        print(json.dumps(summary, indent=2))
        return
    plot(PERF / "scaling.png", projection, measured)
    write_section(PERF / "README.md", "scaling", _section(record), heading="scaling (`scripts/bench_scaling.py`)")
    print(json.dumps(summary, indent=2))


def _section(record: dict) -> str:
    s, setup = record["summary"], record["setup"]
    lost, c = s["node_lost"], s["per_chunk"]
    proj = ", ".join(f"{p['nodes']}: {p['tokens_per_s']:.1f}" for p in s["projection"])
    return "\n".join([
        f"Run {record['run_at']} on {record['machine']}: {setup['cluster']}. Real pair, {setup['dtype']}, every "
        f"weight resident ({setup['device_memory']} budget per replica), batch {setup['batch_size']}, k={setup['k']}, "
        f"one torch thread per role; {setup['rows']} HumanEval prompts cut to {setup['prompt_tokens']} tokens as an "
        f"OpenAI batch file, {setup['new_tokens']} new tokens each (EOS ignored), greedy, chunks of "
        f"{setup['chunk_size']} rows; every run a `ray job submit`.",
        "",
        "| run | job status | tokens/s (generation phase) | job wall s | load avg at submit | busy share, core 0 / 1 |",
        "|---|---|---:|---:|---:|---:|",
        *[f"| {name} | {r['status']} | {r['summary'].get('tokens_per_s', float('nan')):.2f} | {r['wall_s']:.0f} | "
          f"{r.get('load_avg_1min_at_submit', float('nan')):.2f} | "
          f"{' / '.join(f'{b:.2f}' for b in r.get('core_busy_share', []))} |"
          for name, r in record["runs"].items()],
        "",
        f"**scaling_2 = {s['scaling_2']:.2f}x** (goal >= 1.8).",
        "",
        f"Node lost (worker 2's raylet SIGKILLed after the first chunk was written): job {lost['status']}, "
        f"{lost['rows_lost']} rows lost, {lost['rows_duplicated']} duplicated, rows equal to the no-fault run: "
        f"{lost['rows_equal_to_no_fault_run']}. Time to recover, from the kill: the lease lost (detected) "
        f"{_s(lost['lease_lost_after_s'])}, the lost chunk leased again {_s(lost['re_leased_after_s'])} (as soon as "
        f"the other replica was free), done {_s(lost['recovered_after_s'])}; the job's generation phase took "
        f"{lost['extra_job_s_vs_no_fault']:.0f} s longer than without the fault (one replica did the rest). Ray's "
        "default health checks.",
        "",
        f"Per chunk ({c['tokens_per_chunk']} tokens): engine {c['engine_s_per_chunk']:.1f} s with the node to itself "
        f"({c['engine_s_per_chunk_two_on_this_machine']:.1f} s each with two replicas on this one machine), round "
        f"trip overhead (lease to result minus engine) {c['overhead_s_per_chunk'] * 1000:.1f} ms, the driver's "
        f"serial time {c['driver_s_per_chunk'] * 1000:.1f} ms.",
        "",
        f"**Projection (a model, not a measurement)**, tokens/s by nodes: {proj}. X(N) = min(N T / (e + o), T / d) "
        "from the per-chunk costs above; it assumes each node has its own cores and disk, a corpus long enough that "
        "the last wave of chunks does not matter, and one driver (the job's) taking every result. Plot: "
        "`scaling.png`.",
    ])


def _s(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.1f} s"


if __name__ == "__main__":
    main()
