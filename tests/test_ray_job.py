"""Integration: `ray start --head` (token authentication, dashboard on), `ray job submit -- specoffload generate
--backend ray` on a tiny corpus, the job SUCCEEDED and its rows equal the local backend's; an interrupted output is
completed by a resubmission with --resume; a user mistake fails the job with one line. The cluster this
test started is stopped (only its own processes: never `ray stop`, which ends every Ray on the machine).

The cluster uses free ports for everything and its own temp dir, so it does not collide with a local cluster
this session (or anyone else on the machine) runs. Needs `ray[default]` (the Jobs API lives in the dashboard).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.sampling import SamplingParams

BIN = Path(sys.executable).parent
PROMPTS = [[1, 5 + i, 9, 33 + 2 * i, 70 + i][: 2 + i % 4] for i in range(5)]
NEW_TOKENS = 8
PORTS = ("port", "dashboard-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "ray-client-server-port",
         "metrics-export-port", "runtime-env-agent-port", "node-manager-port", "object-manager-port")

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_processes(sid: int) -> list[int]:
    """Live (non-zombie) processes of session `sid`: everything `ray start` spawned, workers included."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):  # fields: state, ppid, pgrp, session
            pids.append(int(stat.parent.name))
    return pids


@pytest.fixture(scope="module")
def ray_head() -> Iterator[tuple[str, dict[str, str]]]:
    """A Ray head started here with token auth on; yields (dashboard address, environment for the CLI)."""
    tmp = Path(tempfile.mkdtemp(prefix="so-ray-", dir="/tmp"))  # short: Ray's socket paths live under it
    token = tmp / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "PATH": f"{BIN}:{env.get('PATH', '')}"}
    ports = {name: _free_port() for name in PORTS}
    args = [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus=2", "--object-store-memory=100000000",
            f"--temp-dir={tmp / 'ray'}", "--disable-usage-stats", "--include-dashboard=true",
            "--dashboard-host=127.0.0.1", *[f"--{name}={port}" for name, port in ports.items()]]
    with open(tmp / "head.log", "w") as log:
        head = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{ports['dashboard-port']}"
    try:
        deadline = time.monotonic() + 90
        while not _dashboard_up(address):
            assert head.poll() is None, f"ray start exited: {(tmp / 'head.log').read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the dashboard did not come up in 90 s"
            time.sleep(0.5)
        yield address, env
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            head.kill()
        for pid in _session_processes(head.pid):  # anything left of this cluster only
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


def _dashboard_up(address: str) -> bool:
    try:
        urllib.request.urlopen(f"{address}/api/version", timeout=2)
    except urllib.error.HTTPError:  # 401: up, and asking for the token
        return True
    except OSError:
        return False
    return True


def _ray(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "ray"), *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_cluster_refuses_the_cli_without_its_token(ray_head):
    address, env = ray_head
    no_token = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    refused = _ray(no_token, "job", "list", f"--address={address}", timeout=60)
    assert refused.returncode != 0 and "auth" in (refused.stdout + refused.stderr).lower()
    assert _ray(env, "job", "list", f"--address={address}", timeout=60).returncode == 0


def _submit(env: dict[str, str], address: str, *cli: str) -> dict:
    """`ray job submit -- specoffload ...`, waited for; returns the job's record from the Jobs REST API."""
    job_id = f"specoffload-test-{secrets.token_hex(4)}"
    submit = _ray(env, "job", "submit", f"--address={address}", f"--submission-id={job_id}", "--",
                  str(BIN / "specoffload"), *cli)
    token = Path(env["RAY_AUTH_TOKEN_PATH"]).read_text()
    request = urllib.request.Request(f"{address}/api/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as response:  # the Jobs REST API, with the cluster's token
        job = json.load(response)
    job["cli_output"] = submit.stdout[-3000:] + submit.stderr[-3000:]
    return job


def test_job_submit_runs_the_cli_on_the_ray_backend_and_resumes(ray_head, tiny_models, tmp_path):
    address, env = ray_head
    config = dict(target=str(tiny_models["llama"]), draft=str(tiny_models["qwen2_draft"]), max_batch_size=3,
                  max_seq_len=48, num_draft_tokens=3, num_threads=1, device_memory="1GiB")
    old = torch.get_num_threads()
    try:
        budget = Engine(EngineConfig(**config)).minimum_device_memory()
        config["device_memory"] = budget
        local = Engine(EngineConfig(**config))
        expected = [r.token_ids for r in local.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS,
                                                                                   ignore_eos=True))]
    finally:
        torch.set_num_threads(old)
    prompts, out = tmp_path / "corpus.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in PROMPTS))
    cli = ["generate", "--backend", "ray", "--target", config["target"], "--draft", config["draft"],
           "--prompts", str(prompts), "-o", str(out), "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos",
           "--batch-size", "3", "--max-seq-len", "48", "-k", "3", "--threads", "1", "--device-memory", str(budget),
           "--chunk-size", "2", "--no-progress"]
    job = _submit(env, address, *cli)
    assert job["status"] == "SUCCEEDED", job
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(len(PROMPTS)))
    assert [row["token_ids"] for row in rows] == expected
    assert all(len(row["token_ids"]) == NEW_TOKENS for row in rows)
    assert "0 recoveries from lost actors" in job["cli_output"]

    # An interrupted job (two rows and a half-written third): a resubmission with --resume completes it.
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])
    job = _submit(env, address, *cli, "--resume")
    assert job["status"] == "SUCCEEDED", job
    assert "2 of 5 prompts already done" in job["cli_output"]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(len(PROMPTS)))  # nothing lost, nothing twice
    assert [row["token_ids"] for row in rows] == expected

    # A user mistake fails the job with one clear line, not a traceback.
    job = _submit(env, address, *cli)  # the output exists and neither --resume nor --overwrite is given
    assert job["status"] == "FAILED"
    assert "already exists" in job["cli_output"] and "Traceback" not in job["cli_output"]
