"""Replica placement on literal data (no cluster): a replica's bundle, and how many replicas a cluster holds. The
pool itself runs on a real multi-node cluster in tests/test_ray_job.py."""

from __future__ import annotations

import pytest

from specoffload.actors import replicas
from specoffload.actors.launcher import bundle_resources, plan_resources
from specoffload.runtime.config import ConfigError, EngineConfig

ROLES = ["coordinator", "prefetch", "attention", "verifier"]


def test_a_replica_bundle_holds_its_five_actors_and_the_replica_resource():
    config = EngineConfig("unused", device_memory="1GiB", num_threads=1)
    resources = plan_resources(config)
    assert bundle_resources(resources, [*ROLES, "draft"], {replicas.REPLICA_RESOURCE: 1.0}) == {
        "CPU": 1.0, replicas.REPLICA_RESOURCE: 1.0}  # 0.1 + 0.1 + 0.3 + 0.3 + 0.2, in Ray's 1e-4 units
    assert bundle_resources(resources, ROLES) == {"CPU": 0.8}


def _node(alive: bool, **resources: float) -> dict:
    return {"Alive": alive, "Resources": resources}


def test_replica_count_from_the_nodes_that_can_hold_a_bundle(monkeypatch, caplog):
    bundle = {"CPU": 1.0, replicas.REPLICA_RESOURCE: 1.0}
    nodes = [_node(True, CPU=1.0), _node(True, CPU=1.0, specoffload_replica=1.0),  # the head offers no replica
             _node(True, CPU=4.0, specoffload_replica=1.0), _node(False, CPU=1.0, specoffload_replica=1.0)]
    monkeypatch.setattr(replicas.ray, "nodes", lambda: nodes)
    assert replicas._replica_count("auto", bundle) == 2
    assert replicas._replica_count(1, bundle) == 1
    assert replicas._replica_count(3, bundle) == 3  # more than are up: the placement group waits for an autoscaler
    assert "waiting for more" in caplog.text
    for bad in (0, -1, "two", True):
        with pytest.raises(ConfigError, match="replicas must be"):
            replicas._replica_count(bad, bundle)
    monkeypatch.setattr(replicas.ray, "nodes", lambda: nodes[:1])
    with pytest.raises(replicas.ReplicaError, match="no node can hold a replica"):
        replicas._replica_count("auto", bundle)
