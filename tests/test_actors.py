"""The actor runtime: role servers + proxies reproduce the local backend; the Ray backend survives killed actors.

Without Ray (fast): the shared-memory tensor store, output lanes, and all four roles served in this process over
their real sockets and arenas, driven by the coordinator engine. With Ray (one session-scoped local cluster):
`connect` + `generate` against the local backend, and each role actor SIGKILLed mid-generation once.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from specoffload.actors.coordinator import RoleWorkers
from specoffload.actors.proxy import LanePool, RemoteTensor, proxy_class
from specoffload.actors.roles import Role, RoleInfo
from specoffload.actors.transport.arena import SHM_DIR, ArenaName
from specoffload.actors.transport.channel import ChannelConfig, Client, RemoteError
from specoffload.actors.transport.codec import TensorRef, WorkerCall
from specoffload.actors.transport.procs import pid_alive
from specoffload.actors.transport.shm import ShmTensors
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.offload.workers import WeightPlan
from specoffload.runtime.sampling import SamplingParams

PROMPTS = [[1, 5 + i, 9, 33 + 2 * i, 70 + i][: 2 + i % 4] for i in range(7)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_new_tokens=16,
                      ignore_eos=True)  # long enough to kill an actor mid-generation
SEEN_PIDS: set[int] = set()  # every process of the shared Ray engine, killed ones included


def _config(tiny_models, target: str, draft: str | None, budget: int | str = "1GiB") -> EngineConfig:
    """draft: a tiny model's name, "self" (the target's resident experts), "lowbit" (its low-bit copy) or None."""
    own = {"drafter": draft} if draft == "lowbit" else {"draft": tiny_models.get(draft, draft)}
    return EngineConfig(tiny_models[target], max_batch_size=3, max_seq_len=48, num_draft_tokens=3,
                        device_memory=budget, num_threads=1, **own)


def _min_budget(tiny_models, target: str, draft: str | None) -> int:
    """The smallest budget for the backend's workers. A drafter built from the target (self, lowbit) in a role
    process keeps its own parts and KV cache (it cannot draft into the attention role's), so its minimum is that of
    a drafter with a cache."""
    if draft in ("self", "lowbit"):
        from specoffload.runtime.models.model import Transformer
        from specoffload.runtime.planning import ModelPair, make_plan, plan_minimum_device_memory

        config = _config(tiny_models, target, draft)
        models = ModelPair.for_config(config, Transformer(config.target), shares_kv=False)
        return plan_minimum_device_memory(config, make_plan(config, models, 48), models)
    old = torch.get_num_threads()  # the engine sets the config's thread count process-wide
    try:
        return Engine(_config(tiny_models, target, draft)).minimum_device_memory()
    finally:
        torch.set_num_threads(old)


@pytest.fixture(scope="module")
def reference(tiny_models):
    """Greedy tokens of the local backend (Engine in-process) at the minimum budget (weights stream)."""
    cache: dict[tuple, list[list[int]]] = {}

    def get(target: str, draft: str | None, params: SamplingParams = GREEDY) -> list[list[int]]:
        key = (target, draft, params)
        if key not in cache:
            old = torch.get_num_threads()
            try:
                engine = Engine(_config(tiny_models, target, draft, _min_budget(tiny_models, target, draft)))
                assert engine.placement.streamed_layers
                cache[key] = [r.token_ids for r in engine.generate(PROMPTS, params)]
            finally:
                torch.set_num_threads(old)
        return cache[key]

    return get


def _files_of(pids: set[int]) -> list[str]:
    """Our /dev/shm arenas and ipc sockets owned by any of `pids`."""
    arenas = [p.name for p in SHM_DIR.iterdir() if (n := ArenaName.parse(p.name)) is not None and n.pid in pids]
    sockets = [p.name for p in Path(ChannelConfig("probe").socket_dir).glob("specoffload-*-*.sock")
               if int(p.name.split("-")[1]) in pids]
    return arenas + sockets


# ------------------------------------------------------------------------------------------- without Ray


def test_shm_tensors_round_trip_grow_and_close(tmp_path):
    mine, theirs = ShmTensors("testa"), ShmTensors("testb")
    try:
        x = torch.arange(12, dtype=torch.float32).view(3, 4)
        ref = mine.write("k", x)
        assert ref.shape == (3, 4) and ref.dtype == "float32"
        view = theirs.read(ref)  # attaches the other "process"'s arena, zero copy
        assert torch.equal(view, x)
        mine.write("k", x + 1)  # same key: same region, overwritten in place
        assert torch.equal(view, x + 1)
        first = mine.paths[0]
        big = torch.ones(70_000, dtype=torch.float32)  # outgrows the 64 KiB arena: a new, larger one
        ref2 = mine.write("k", big)
        assert ref2.arena != ref.arena and not first.exists()
        assert torch.equal(theirs.read(ref2), big)
        assert all(p.exists() for p in mine.paths)
    finally:
        paths = mine.paths
        mine.close()
        theirs.close()
    assert not any(p.exists() for p in paths)


def test_lanes_return_to_the_pool_when_the_last_handle_is_freed():
    pool = LanePool()
    ref = TensorRef("specoffload-x-1-y", 0, "float32", (1,))
    a = RemoteTensor(ref, pool.acquire())
    b = RemoteTensor(ref, pool.acquire())
    assert (a.lane.id, b.lane.id) == (0, 1)
    a2 = RemoteTensor(ref, a.lane)  # the next result of the same chain keeps its lane
    del a
    gc.collect()
    assert pool.in_use == 2  # a2 still holds lane 0
    del a2
    gc.collect()
    assert pool.in_use == 1
    assert pool.acquire().id == 0  # the lowest free lane is reused


def test_pid_alive_counts_a_zombie_as_dead():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while pid_alive(child.pid) and time.monotonic() < deadline:  # exited, not reaped: a zombie
        time.sleep(0.01)
    assert not pid_alive(child.pid)
    assert os.path.exists(f"/proc/{child.pid}")  # still a zombie until waited for
    child.wait()
    assert pid_alive(os.getpid())


def test_pid_exited_waits_for_every_thread():
    """A killed multi-threaded child is exited only once no thread is left (its sockets are closed by then)."""
    from specoffload.actors.transport.procs import pid_exited

    code = "import threading, time; [threading.Thread(target=time.sleep, args=(60,)).start() for _ in range(4)]; " \
           "time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.3)
        assert not pid_exited(child.pid)
        child.kill()
        deadline = time.monotonic() + 10
        while not pid_exited(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pid_exited(child.pid) and not pid_alive(child.pid)
    finally:
        child.kill()
        child.wait()


class InProcessGroup:
    """The roles served by threads of this process over their real sockets and arenas: the wire without Ray."""

    def __init__(self, config: EngineConfig, roles: list[str]) -> None:
        self.actors = {role: Role(role, config, 1) for role in roles}
        self.infos: dict[str, RoleInfo] = {}

    def setup(self, plan: WeightPlan) -> dict[str, RoleInfo]:
        infos = {"prefetch": self.actors["prefetch"].setup(plan)}
        for role, actor in self.actors.items():
            if role != "prefetch":
                infos[role] = actor.setup(plan, infos["prefetch"].slot_paths)
        self.infos = infos
        return infos

    def drop(self, role: str) -> None:
        self.actors.pop(role).shutdown()

    def pids(self) -> dict[str, int]:
        return {role: info.pid for role, info in self.infos.items()}

    def shutdown(self) -> None:
        for actor in self.actors.values():
            actor.shutdown()


def in_process_engine(config: EngineConfig) -> tuple[Engine, RoleWorkers]:
    """The coordinator's engine over roles served in this process: the Ray backend's wiring without Ray."""
    roles = RoleWorkers(InProcessGroup(config, ["prefetch", "attention", "verifier", "draft"]))
    return Engine(config, workers=roles, recovery=roles), roles


@pytest.mark.parametrize(
    ("target", "draft"),
    [("llama", "qwen2_draft"), ("llama", None), ("qwen2_moe", "qwen2_draft"), ("mixtral", None), ("mixtral", "self"),
     ("qwen2_moe", "lowbit")],
)
def test_roles_over_sockets_and_arenas_match_the_local_backend(tiny_models, reference, single_thread, target, draft):
    engine, roles = in_process_engine(_config(tiny_models, target, draft, _min_budget(tiny_models, target, draft)))
    try:
        assert engine.placement.streamed_layers
        # lossless: a target drafting for itself (the reference runs it locally at another budget) equals no draft
        expected = reference(target, None if draft in ("self", "lowbit") else draft)
        assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == expected
        stats = engine.last_stats
        assert stats.bytes_read > 0 and stats.generated_tokens == len(PROMPTS) * GREEDY.max_new_tokens
        assert roles.lanes.in_use <= 2  # one chain per batch at most, freed after verify
        assert ("draft" in roles.proxies) == (draft is not None)  # no drafter role when the plan does not draft
        files = _files_of({os.getpid()})
        assert any("-slot0" in f for f in files) and any(f.endswith("-prefetch.sock") for f in files)
    finally:
        engine.close()
        roles.close()
    assert not any("-prefetch" in f or "-slot" in f or "-attention" in f for f in _files_of({os.getpid()}))


def test_seeded_sampling_over_the_wire_matches_the_local_backend(tiny_models, reference, single_thread):
    """Draws are per request (runtime/rng.py), wherever the workers run: a seeded sample is the same sample."""
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    engine, roles = in_process_engine(_config(tiny_models, "llama", "qwen2_draft",
                                              _min_budget(tiny_models, "llama", "qwen2_draft")))
    try:
        assert [r.token_ids for r in engine.generate(PROMPTS, params)] == reference("llama", "qwen2_draft", params)
        assert engine.last_stats.num_drafted > 0
    finally:
        engine.close()
        roles.close()


def test_penalties_min_tokens_and_logprobs_over_the_wire_match_the_local_backend(tiny_models, single_thread):
    """The head's logits stay in the verifier's arena over the wire: rows that process them (penalties, min_tokens)
    or report logprobs read them once (`VerifierWorker.logits`), and get what the local backend gets."""
    params = SamplingParams(max_new_tokens=8, temperature=0.9, seed=7, ignore_eos=False, min_tokens=6,
                            repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2, logprobs=2)
    config = _config(tiny_models, "llama", "qwen2_draft", _min_budget(tiny_models, "llama", "qwen2_draft"))
    old = torch.get_num_threads()
    try:
        local = Engine(config).generate(PROMPTS, params)
    finally:
        torch.set_num_threads(old)
    engine, roles = in_process_engine(config)
    try:
        remote = engine.generate(PROMPTS, params)
        assert engine.last_stats.num_drafted > 0
    finally:
        engine.close()
        roles.close()
    assert [r.token_ids for r in remote] == [r.token_ids for r in local]
    assert all(r.logprobs and len(r.logprobs) == len(r.token_ids) for r in remote)
    for a, b in zip(remote, local):
        for x, y in zip(a.logprobs, b.logprobs):
            assert [t for t, *_ in x] == [t for t, *_ in y] and [lp for _, lp, _ in x] == pytest.approx(
                [lp for _, lp, _ in y], rel=1e-5, abs=1e-6)


def test_roles_and_proxies_are_derived_from_the_worker_classes(tiny_models, single_thread):
    """The worker interface is declared once (@wire): each role serves exactly its worker class's wire methods, and
    the generated proxy has each of them with the worker's own signature, and nothing else public."""
    import inspect

    from specoffload.runtime.offload.wire import wire_methods
    from specoffload.runtime.offload.workers import worker_classes

    config = _config(tiny_models, "llama", "qwen2_draft")
    classes = worker_classes(config)
    expected = {
        "prefetch": {"load"},
        "attention": {"reset", "drop", "lengths", "advance", "truncate", "select_rows", "reset_rows", "embed",
                      "attention", "free_blocks", "reserve", "block_size", "add_rows"},
        "verifier": {"ffn", "head", "logits", "verify", "routing_counts"},
        "draft": {"reset", "drop", "lengths", "advance", "truncate", "select_rows", "reset_rows", "add_rows", "propose",
                  "adapt"},
    }
    for role, cls in classes.items():
        methods = wire_methods(cls)
        assert set(methods) == expected[role], role
        assert Role(role, config, 1).methods == frozenset(methods)
        proxy = proxy_class(cls)
        for name, spec in methods.items():
            assert inspect.signature(getattr(proxy, name)) == spec.signature
            assert getattr(proxy, name).__doc__ == spec.doc
        assert {m.name for m in methods.values() if m.keep_outputs} <= {"embed", "attention", "ffn", "head"}
    assert wire_methods(classes["verifier"])["verify"].returns_tuple
    assert not wire_methods(classes["attention"])["lengths"].returns_tuple


def test_a_role_refuses_what_is_not_a_worker_method(tiny_models, single_thread):
    role = Role("attention", _config(tiny_models, "llama", None), 1)
    info = role.setup(Engine(_config(tiny_models, "llama", None)).weight_plan)
    try:
        assert info.channel.address.startswith("ipc://")  # ZeroMQ over ipc by default, never a network port
        with Client(info.channel) as client:
            with pytest.raises(RemoteError, match="no method 'close'"):
                client.call(WorkerCall("close"), timeout_s=10)
            client.call(WorkerCall("reset", scalars={"batch": 0, "rows": 2, "capacity": 8}), timeout_s=10)
            assert client.call(WorkerCall("lengths", scalars={"batch": 0}), timeout_s=10).values == ([0, 0],)
    finally:
        role.shutdown()


# ------------------------------------------------------------------------------------------------ with Ray


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def dense_engine(ray_session, tiny_models):
    """llama + draft at the minimum budget, shared by the tests below (an actor group starts in ~10 s)."""
    from specoffload.actors import connect

    # calls of tiny models take milliseconds: 8 s without a reply from a live role is a hang
    handle = connect(_config(tiny_models, "llama", "qwen2_draft", _min_budget(tiny_models, "llama", "qwen2_draft")),
                     call_timeout_s=8.0)
    SEEN_PIDS.update(handle.pids().values())
    yield handle
    handle.shutdown()


def test_ray_backend_matches_the_local_backend(dense_engine, reference):
    results = dense_engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == reference("llama", "qwen2_draft")
    assert [r.index for r in results] == list(range(len(PROMPTS)))
    stats = dense_engine.stats()
    assert stats["bytes_read"] > 0 and stats["num_drafted"] > 0 and stats["recoveries"] == 0
    assert set(stats["pids"]) == {"prefetch", "attention", "verifier", "draft"}


def test_ray_roles_talk_over_ipc_and_share_the_loaders_slots(dense_engine):
    roles = dense_engine.roles()
    slots = roles["prefetch"].slot_paths
    assert slots and all(f"-{roles['prefetch'].pid}-slot" in s for s in slots)  # owned (pid-tagged) by the loader
    for info in roles.values():
        assert info.channel.address == f"ipc://{info.channel.socket_dir}/specoffload-{info.pid}-{info.role}.sock"
        assert Path(str(info.channel.socket_path)).exists()
    assert roles["attention"].slot_paths == roles["verifier"].slot_paths == slots


@pytest.mark.parametrize("role", ["prefetch", "attention", "verifier", "draft"])
def test_a_role_killed_mid_generation_is_restarted_and_nothing_changes(dense_engine, reference, role):
    expected = reference("llama", "qwen2_draft", LONG)
    victim = dense_engine.pids()[role]
    thread, out = _run_in_thread(dense_engine, LONG)
    os.kill(victim, signal.SIGKILL)
    thread.join(timeout=120)
    assert not thread.is_alive(), "generate hung after the kill"
    assert "error" not in out, out.get("error")
    tokens = [r.token_ids for r in out["results"]]
    assert tokens == expected  # nothing lost, nothing duplicated
    stats = dense_engine.stats()
    assert stats["recoveries"] == 1
    assert stats["generated_tokens"] == len(PROMPTS) * LONG.max_new_tokens
    new_pid = dense_engine.pids()[role]
    assert new_pid != victim and not pid_alive(victim)
    SEEN_PIDS.update((victim, new_pid))


def _run_in_thread(handle, params: SamplingParams) -> tuple[threading.Thread, dict]:
    """Start handle.generate(PROMPTS, params) in a thread; return when it has verified two rounds."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["results"] = handle.generate(PROMPTS, params)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 60
    while not ((p := handle.progress())["running"] and p["verified"] >= 2):
        assert time.monotonic() < deadline and thread.is_alive(), f"generation did not get going: {out}"
        time.sleep(0.01)
    return thread, out


def test_a_hung_role_is_killed_restarted_and_nothing_changes(dense_engine, reference):
    """SIGSTOP leaves the attention actor alive but silent: after the call timeout it counts as hung, is killed
    (Ray restarts it) and the generation replays; the tokens are those of an undisturbed run."""
    expected = reference("llama", "qwen2_draft", LONG)
    victim = dense_engine.pids()["attention"]
    thread, out = _run_in_thread(dense_engine, LONG)
    os.kill(victim, signal.SIGSTOP)
    thread.join(timeout=120)
    assert not thread.is_alive(), "generate hung on a stopped role"
    assert "error" not in out, out.get("error")
    assert [r.token_ids for r in out["results"]] == expected
    stats = dense_engine.stats()
    assert stats["recoveries"] == 1 and stats["lost"]["attention"] >= 1
    assert dense_engine.pids()["attention"] != victim
    SEEN_PIDS.add(dense_engine.pids()["attention"])


def test_a_spent_restart_budget_fails_at_once_and_a_dead_coordinator_is_one_clear_error(ray_session, tiny_models):
    """max_restarts = 0: the first lost role fails the call at once with RestartsExhausted (no wait on an actor Ray
    will not restart). Then the coordinator itself is killed: the next call is an EngineLost line, and shutdown
    still removes every arena and socket."""
    from specoffload.actors import connect
    from specoffload.actors.client import EngineLost
    from specoffload.actors.coordinator import RestartsExhausted

    handle = connect(_config(tiny_models, "llama", None, _min_budget(tiny_models, "llama", None)), max_restarts=0)
    pids = set(handle.pids().values())
    try:
        thread, out = _run_in_thread(handle, LONG)
        start = time.monotonic()
        os.kill(handle.pids()["verifier"], signal.SIGKILL)
        thread.join(timeout=60)
        assert not thread.is_alive() and time.monotonic() - start < 30
        assert isinstance(out.get("error"), RestartsExhausted), out
        assert "max_restarts = 0" in str(out["error"])
        os.kill(handle.pids()["coordinator"], signal.SIGKILL)
        with pytest.raises(EngineLost, match="coordinator actor died"):
            handle.generate(PROMPTS, GREEDY)
    finally:
        handle.shutdown()
    assert _files_of(pids) == []


def test_shutdown_after_the_kills_leaves_no_shared_memory_or_socket(dense_engine):
    pids = SEEN_PIDS | set(dense_engine.pids().values())
    assert len(pids) >= 5
    dense_engine.shutdown()
    assert _files_of(pids) == []


def test_ray_backend_moe_without_draft(ray_session, tiny_models, reference):
    from specoffload.actors import connect

    with connect(_config(tiny_models, "qwen2_moe", None, _min_budget(tiny_models, "qwen2_moe", None))) as handle:
        pids = set(handle.pids().values())
        assert set(handle.pids()) == {"coordinator", "prefetch", "attention", "verifier"}  # no draft actor
        assert [r.token_ids for r in handle.generate(PROMPTS, GREEDY)] == reference("qwen2_moe", None)
        assert handle.stats()["num_drafted"] == 0
    assert _files_of(pids) == []
