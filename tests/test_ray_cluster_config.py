"""ray_cluster.yaml: valid for Ray's cluster launcher, token authentication on every node (the token provisioned by
file_mounts), the dashboard not exposed, and the replica resource offered where replicas should go."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from specoffload.actors.replicas import REPLICA_RESOURCE

CONFIG = Path(__file__).resolve().parent.parent / "ray_cluster.yaml"


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(CONFIG.read_text())


def test_the_cluster_launcher_accepts_it(config):
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(dict(config)))


def test_every_node_starts_with_the_token_that_file_mounts_provisions(config):
    starts = [c for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2
    mounted = {str(Path(k.replace("~", "$HOME"))) for k in config["file_mounts"]}
    for command in starts:
        assert "RAY_AUTH_MODE=token" in command
        token = re.search(r"RAY_AUTH_TOKEN_PATH=(\S+)", command).group(1)
        assert token in mounted, f"{token} is not provisioned by file_mounts"
    assert any("test -s ~/.ray/auth_token" in c for c in config["setup_commands"])  # no token: setup stops


def test_the_dashboard_listens_on_localhost_only(config):
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head


def test_replicas_request_the_resource_the_gpu_workers_offer(config):
    types = config["available_node_types"]
    assert types["gpu_worker"]["resources"] == {REPLICA_RESOURCE: 1}
    assert REPLICA_RESOURCE not in types["head"]["resources"]
    assert types["gpu_worker"]["min_workers"] >= 2
