"""Integration: a real multi-node Ray cluster on this machine (scripts/local_cluster.py: a head and two worker nodes
started with `ray start`, each its own raylet, token authentication on, dashboard on), `ray job submit -- specoffload
generate --backend ray` on tiny corpora.

1. One replica: the job SUCCEEDED and its rows equal the local backend's; a user mistake (an existing output without
   --resume) fails the job with one line. (Resuming is the job driver's, the same for every backend: tests/test_cli.py
   and tests/test_offline.py cover it; a resubmission here would cost another replica start and check nothing new.)
2. Two replicas on the two worker nodes, an OpenAI batch file with bad rows, resuming what a local run left (its
   first rows, a half-written line, its manifest), and one worker node's raylet SIGKILLed mid-job: every custom_id
   appears exactly once, in input order, with the local backend's output; the lost node's lease was redone on the
   other replica.

The cluster uses free ports for everything and its own temp dir, so it does not collide with a local cluster this
session (or anyone else on the machine) runs, and it is stopped by ending only its own processes (never `ray stop`).
Needs `ray[default]` (the Jobs API lives in the dashboard).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from scripts.local_cluster import BIN, LocalCluster
from specoffload.actors.transport.arena import SHM_DIR, ArenaName
from specoffload.runtime.cli import main
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.sampling import SamplingParams

PROMPTS = [[1, 5 + i, 9, 33 + 2 * i, 70 + i][: 2 + i % 4] for i in range(5)]
NEW_TOKENS = 8

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LocalCluster]:
    """A head (the job drivers run there) and two worker nodes that offer one replica each; node deaths are noticed
    within ~3 s (health checks every second)."""
    with LocalCluster(head_cpus=1, health_check_s=1.0) as cluster:
        for _ in range(2):
            cluster.add_worker(cpus=1, resources={"specoffload_replica": 1})
        yield cluster


@pytest.fixture(scope="module")
def ray_head(ray_cluster: LocalCluster) -> tuple[str, dict[str, str]]:
    """(dashboard address, environment for the CLI: token, no RAY_ADDRESS)."""
    return ray_cluster.dashboard, {k: v for k, v in ray_cluster.env.items() if k != "RAY_ADDRESS"}


def _ray(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "ray"), *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_cluster_refuses_the_cli_without_its_token(ray_head):
    address, env = ray_head
    no_token = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    refused = _ray(no_token, "job", "list", f"--address={address}", timeout=60)
    assert refused.returncode != 0 and "auth" in (refused.stdout + refused.stderr).lower()
    assert _ray(env, "job", "list", f"--address={address}", timeout=60).returncode == 0


def _submit(env: dict[str, str], address: str, *cli: str, wait: bool = True) -> dict:
    """`ray job submit -- specoffload ...` (waited for unless `wait` is False); returns the job's record from the
    Jobs REST API (with the cluster's token) and the CLI's output."""
    job_id = f"specoffload-test-{secrets.token_hex(4)}"
    submit = _ray(env, "job", "submit", f"--address={address}", f"--submission-id={job_id}",
                  *([] if wait else ["--no-wait"]), "--", str(BIN / "specoffload"), *cli)
    job = _job(env, address, job_id)
    job["cli_output"] = submit.stdout[-3000:] + submit.stderr[-3000:]
    return job


def _job(env: dict[str, str], address: str, job_id: str) -> dict:
    import urllib.request

    token = Path(env["RAY_AUTH_TOKEN_PATH"]).read_text()
    request = urllib.request.Request(f"{address}/api/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response) | {"submission_id": job_id}


def test_job_submit_runs_the_cli_on_the_ray_backend(ray_head, tiny_models, tmp_path):
    address, env = ray_head
    config = dict(target=str(tiny_models["llama"]), draft=str(tiny_models["qwen2_draft"]), max_batch_size=3,
                  max_seq_len=48, num_draft_tokens=3, num_threads=1, device_memory="1GiB")
    old = torch.get_num_threads()
    try:
        budget = Engine(EngineConfig(**config)).minimum_device_memory()
        config["device_memory"] = budget
        local = Engine(EngineConfig(**config))
        expected = [r.token_ids for r in local.generate(PROMPTS, SamplingParams(temperature=0.0,
                                                                                max_new_tokens=NEW_TOKENS,
                                                                                   ignore_eos=True))]
    finally:
        torch.set_num_threads(old)
    prompts, out = tmp_path / "corpus.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in PROMPTS))
    cli = ["generate", "--backend", "ray", "--target", config["target"], "--draft", config["draft"],
           "--prompts", str(prompts), "-o", str(out), "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos",
           "--batch-size", "3", "--max-seq-len", "48", "-k", "3", "--threads", "1", "--device-memory", str(budget),
           "--chunk-size", "2", "--no-progress", "--temperature", "0"]
    job = _submit(env, address, *cli)
    assert job["status"] == "SUCCEEDED", job
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(len(PROMPTS)))
    assert [row["token_ids"] for row in rows] == expected
    assert all(len(row["token_ids"]) == NEW_TOKENS for row in rows)
    assert "0 recoveries from lost actors" in job["cli_output"]

    # A user mistake fails the job with one clear line, not a traceback.
    job = _submit(env, address, *cli)  # the output exists and neither --resume nor --overwrite is given
    assert job["status"] == "FAILED"
    assert "already exists" in job["cli_output"] and "Traceback" not in job["cli_output"]


def _batch(rows: int) -> tuple[list[str], set[int]]:
    """An OpenAI batch: completions on token ids, every fourth sampled with its own seed (every eighth with n = 2
    and logprobs), and three bad rows."""
    lines = []
    for i in range(rows):
        body: dict = {"prompt": [1, 5 + i % 7, 9, 33 + i, 70 + i % 5][: 2 + i % 4], "max_tokens": 10 + i % 3}
        if i % 4 == 1:
            body |= {"temperature": 0.9, "seed": 100 + i}
        if i % 8 == 5:  # two samples, each with its top-2 logprobs per token (one sample row each on the replicas)
            body |= {"n": 2, "logprobs": 2}
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": body}))
    bad = {3: "{broken", 11: json.dumps({"custom_id": "req-11", "url": "/v1/embeddings", "body": {"input": "x"}}),
           17: json.dumps({"custom_id": "req-17", "url": "/v1/completions", "body": {"prompt": list(range(1, 60))}})}
    for i, line in bad.items():
        lines[i] = line
    return lines, set(bad)


def _comparable(row: dict) -> dict:
    """An output line without what differs between runs (the creation time and the random ids) and without its
    logprob values (rows batched with other rows add in another order: the floats differ in the last bits; see
    `_logprob_values`)."""
    row = json.loads(json.dumps(row))
    del row["id"]
    if row.get("response"):
        for key in ("created", "id"):
            del row["response"]["body"][key]
        del row["response"]["request_id"]
        for choice in row["response"]["body"]["choices"]:
            if choice.get("logprobs"):
                lp = choice["logprobs"]
                lp["token_logprobs"] = None
                lp["top_logprobs"] = [sorted(top) for top in lp["top_logprobs"]]
    return row


def _logprob_values(row: dict) -> list[float]:
    """Every logprob value of an output line, in order."""
    values: list[float] = []
    for choice in (row.get("response") or {}).get("body", {}).get("choices", []):
        if choice.get("logprobs"):
            values += choice["logprobs"]["token_logprobs"]
            values += [x for top in choice["logprobs"]["top_logprobs"] for _, x in sorted(top.items())]
    return values


def _arenas_of(pids: set[int]) -> list[str]:
    return [p.name for p in SHM_DIR.iterdir() if (n := ArenaName.parse(p.name)) is not None and n.pid in pids]


#: rows of the lost-node job: enough that the victim still holds leases when the first chunk is written, even on a
#: fast run (48 rows once finished on both replicas, 3 s of generation, before the kill took effect: a flake)
ROWS = 96


def test_two_replicas_on_two_nodes_resume_and_survive_a_lost_node(ray_cluster, tiny_models, tmp_path):
    """Runs last: it kills a worker node. ROWS rows: a replica leases chunks while its rows in flight fill its batches
    twice (replicas.py), so the victim still holds leases when the first chunk is written."""
    address, env = ray_cluster.dashboard, {k: v for k, v in ray_cluster.env.items() if k != "RAY_ADDRESS"}
    lines, bad = _batch(ROWS)
    batch, out, ref = tmp_path / "batch.jsonl", tmp_path / "out.jsonl", tmp_path / "ref.jsonl"
    batch.write_text("\n".join(lines) + "\n")
    cli = ["generate", "--target", str(tiny_models["llama"]), "--draft", str(tiny_models["qwen2_draft"]),
           "--prompts", str(batch), "--max-new-tokens", "10", "--ignore-eos", "--batch-size", "3", "--max-seq-len",
           "48", "-k", "3", "--threads", "1", "--device-memory", "1GiB", "--chunk-size", "2", "--no-progress",
           "--temperature", "0"]
    old = torch.get_num_threads()
    try:
        assert main([*cli, "-o", str(ref)]) == 0  # the local backend: the reference rows (and three failed)
    finally:
        torch.set_num_threads(old)
    # A local run was interrupted after two rows and half a third; the cluster resumes it (same manifest).
    kept = ref.read_text().splitlines(keepends=True)
    out.write_text("".join(kept[:2]) + kept[2][:20])
    Path(f"{out}.manifest.json").write_text(Path(f"{ref}.manifest.json").read_text())
    summary = tmp_path / "summary.json"
    job = _submit(env, address, *cli, "-o", str(out), "--backend", "ray", "--replicas", "2", "--resume",
                  "--summary", str(summary), wait=False)
    victim = ray_cluster.nodes[2]
    deadline = time.monotonic() + 180
    while out.read_text().count("\n") < 4:  # a chunk of this job is written: both replicas are busy
        assert _job(env, address, job["submission_id"])["status"] in ("PENDING", "RUNNING"), "job ended early"
        assert time.monotonic() < deadline, "no chunk was written in 180 s"
        time.sleep(0.2)
    victim_pids = set(victim.processes())
    ray_cluster.kill_raylet(victim)
    while (record := _job(env, address, job["submission_id"]))["status"] in ("PENDING", "RUNNING"):
        assert time.monotonic() < deadline + 120, "the job did not finish after the node was lost"
        time.sleep(1)
    logs = _ray(env, "job", "logs", f"--address={address}", job["submission_id"]).stdout
    assert record["status"] == "SUCCEEDED", logs  # the job ran: three rows failed, each an error row
    assert f"3 of {ROWS} rows failed" in logs and "Traceback" not in logs, logs
    assert f"2 of {ROWS} prompts already done" in logs, logs
    assert "lost its lease on chunk" in logs and "goes back to the queue" in logs, logs
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [row["custom_id"] for row in rows]
    assert ids == [None if i == 3 else f"req-{i}" for i in range(ROWS)]  # every row once, in input order
    assert {i for i, row in enumerate(rows) if row["error"] is not None} == bad
    reference = [json.loads(line) for line in ref.read_text().splitlines()]
    assert [_comparable(r) for r in rows] == [_comparable(r) for r in reference]  # the local backend's output
    for row, ref_row in zip(rows, reference):
        assert _logprob_values(row) == pytest.approx(_logprob_values(ref_row), rel=1e-4, abs=1e-5)
    sampled = rows[5]["response"]["body"]  # n = 2 with logprobs came back through the replicas as on the local one
    assert [c["index"] for c in sampled["choices"]] == [0, 1] and all(c["logprobs"] for c in sampled["choices"])
    requests = json.loads(summary.read_text())["requests"]  # per-request metrics came back from the replicas
    written = ROWS - 2 - len(bad - {0, 1})  # (this run's rows: not the two resumed ones, not the error rows)
    assert requests["time_to_first_token_s"]["count"] == requests["new_tokens"]["count"] == written
    assert requests["acceptance"]["count"] == written and 0 <= requests["acceptance"]["mean"] <= 1
    deadline = time.monotonic() + 30
    while _arenas_of(victim_pids) and time.monotonic() < deadline:  # the dead replica's shared memory is swept
        time.sleep(0.5)
    assert _arenas_of(victim_pids) == []
