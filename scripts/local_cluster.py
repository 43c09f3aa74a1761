"""A real multi-node Ray cluster on this machine, for tests and benchmarks: a head and worker nodes, each started
with `ray start` (its own raylet, object store and dashboard agent), token authentication on, every port picked
free, its own temp dir. It is stopped by ending only the processes it started (never `ray stop`, which ends every
Ray on the machine), and a worker node can be killed the way a machine dies: SIGKILL to its raylet.

    with LocalCluster(health_check_s=1) as cluster:
        cluster.add_worker(cpus=1, resources={"specoffload_replica": 1}, cores={0})
        cluster.wait_for_nodes(2)
        ... cluster.env (RAY_ADDRESS, token) for `ray job submit --address cluster.dashboard` ...

Worker nodes may be pinned to cores (`cores`): everything the raylet starts (the actors of the replica placed
there) inherits its CPU affinity, so a replica really is limited to those cores.
"""

from __future__ import annotations

import contextlib
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
from dataclasses import dataclass
from pathlib import Path

BIN = Path(sys.executable).parent
HEAD_PORTS = ("port", "dashboard-port", "ray-client-server-port")
NODE_PORTS = ("node-manager-port", "object-manager-port", "metrics-export-port", "dashboard-agent-listen-port",
              "dashboard-agent-grpc-port", "runtime-env-agent-port")
OBJECT_STORE_BYTES = 100_000_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_processes(sid: int) -> list[int]:
    """Live (non-zombie) processes of session `sid`: everything one `ray start` spawned, workers included."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):  # fields: state, ppid, pgrp, session
            pids.append(int(stat.parent.name))
    return pids


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@dataclass
class Node:
    name: str
    process: subprocess.Popen
    log: Path

    def processes(self) -> list[int]:
        return session_processes(self.process.pid)

    def raylet_pid(self) -> int | None:
        return next((p for p in self.processes() if _comm(p) == "raylet"), None)


class LocalCluster:
    """See the module docstring. head_cpus: the head's logical CPUs (the job driver runs there). health_check_s:
    how often the GCS checks each raylet (3 failures mark a node dead); None: Ray's defaults."""

    def __init__(self, head_cpus: int = 1, health_check_s: float | None = None, head_cores: set[int] | None = None
                 ) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="so-ray-", dir="/tmp"))  # short: Ray's socket paths live under it
        token = self.tmp / "token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env = env | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
                          "PATH": f"{BIN}:{env.get('PATH', '')}"}
        self.token = token.read_text()
        self.nodes: list[Node] = []
        ports = {name: free_port() for name in HEAD_PORTS + NODE_PORTS}
        self.gcs = f"127.0.0.1:{ports['port']}"
        self.dashboard = f"http://127.0.0.1:{ports['dashboard-port']}"
        head_env = dict(self.env)
        if health_check_s is not None:
            ms = str(int(health_check_s * 1000))
            head_env |= {"RAY_health_check_period_ms": ms, "RAY_health_check_timeout_ms": ms,
                         "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "0"}
        try:
            self._start("head", ["--head", f"--num-cpus={head_cpus}", "--include-dashboard=true",
                                 "--dashboard-host=127.0.0.1"], ports, head_env, head_cores)
            deadline = time.monotonic() + 90
            while not self._dashboard_up():
                head = self.nodes[0]
                assert head.process.poll() is None, f"ray start exited: {head.log.read_text()[-2000:]}"
                assert time.monotonic() < deadline, "the dashboard did not come up in 90 s"
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.env["RAY_ADDRESS"] = self.gcs

    def _start(self, name: str, args: list[str], ports: dict[str, int], env: dict[str, str],
               cores: set[int] | None) -> Node:
        cmd = [str(BIN / "ray"), "start", "--block", "--node-ip-address=127.0.0.1",
               f"--object-store-memory={OBJECT_STORE_BYTES}", f"--temp-dir={self.tmp / 'ray'}",
               "--disable-usage-stats", *args, *[f"--{k}={v}" for k, v in ports.items()]]
        log = self.tmp / f"{name}.log"
        with open(log, "w") as out:
            process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                       preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
        node = Node(name, process, log)
        self.nodes.append(node)
        return node

    def add_worker(self, cpus: int = 1, resources: dict[str, float] | None = None, cores: set[int] | None = None,
                   timeout_s: float = 120) -> Node:
        """Start a worker node (its own raylet), and wait until it has joined (one at a time: nodes that start
        together on a busy machine can time out registering)."""
        args = [f"--address={self.gcs}", f"--num-cpus={cpus}"]
        if resources:
            args.append(f"--resources={json.dumps(resources)}")
        node = self._start(f"worker{len(self.nodes)}", args, {n: free_port() for n in NODE_PORTS}, self.env, cores)
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in node.log.read_text():
            assert node.process.poll() is None, f"{node.name} exited: {node.log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"{node.name} did not start in {timeout_s:.0f} s"
            time.sleep(0.3)
        return node

    def alive_nodes(self) -> int:
        status = subprocess.run([str(BIN / "ray"), "list", "nodes", f"--address={self.dashboard}", "--format=json",
                                 "--filter", "state=ALIVE"], env=self.env, capture_output=True, text=True, timeout=60)
        try:
            return len(json.loads(status.stdout))
        except ValueError:
            return 0

    def wait_for_nodes(self, count: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while self.alive_nodes() < count:
            for node in self.nodes:
                assert node.process.poll() is None, f"{node.name} exited: {node.log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"{count} nodes did not come up in {timeout_s:.0f} s"
            time.sleep(1)

    def kill_raylet(self, node: Node) -> int:
        """SIGKILL the node's raylet, as if its machine died; returns the raylet's pid."""
        pid = node.raylet_pid()
        assert pid is not None, f"{node.name} has no raylet"
        os.kill(pid, signal.SIGKILL)
        return pid

    def job(self, job_id: str) -> dict:
        """A job's record from the Jobs REST API (with the cluster's token)."""
        request = urllib.request.Request(f"{self.dashboard}/api/jobs/{job_id}",
                                         headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)

    def _dashboard_up(self) -> bool:
        try:
            urllib.request.urlopen(f"{self.dashboard}/api/version", timeout=2)
        except urllib.error.HTTPError:  # 401: up, and asking for the token
            return True
        except OSError:
            return False
        return True

    def stop(self) -> None:
        """End the workers, then the head (`ray start --block` stops what it started), then anything left of them."""
        for node in reversed(self.nodes):
            if node.process.poll() is None:
                node.process.send_signal(signal.SIGTERM)
        for node in reversed(self.nodes):
            try:
                node.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                node.process.kill()
            for pid in node.processes():  # this cluster's processes only
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.nodes = []
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
