"""Shared fixtures. `tiny_models`: tiny random HF checkpoints (see scripts/make_tiny_models.py), built once."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from specoffload.planner.placement import ModelShape
from specoffload.planner.shapes import PartKey

#: the test files that start or join Ray (a cluster of their own, a local instance, or `connect`'s "join the one found
#: on this machine"): one pytest-xdist work unit, so no two of them run at once (a second instance finds the first's
#: GCS, its ports race the first's), collected first, so that one worker takes them while the other takes the rest
#: file by file (scripts/test.sh: --dist loadfile); they are also the suite's longest files (minutes on 2 cores)
RAY_FILES = ("test_ray_job.py", "test_actors.py", "test_ray_data.py", "test_readme_snippets.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """RAY_FILES first, in that order; every other test in its collected order."""
    rank = {name: i for i, name in enumerate(RAY_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(RAY_FILES)))


if importlib.util.find_spec("xdist") is not None:  # the hook exists only with pytest-xdist installed

    def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
        """--dist loadfile with RAY_FILES as one unit (pytest-xdist's own --dist loadgroup marks do not group on
        pytest 9: its worker renames items through a private attribute that pytest 9 no longer reads)."""
        if config.getvalue("dist") != "loadfile":
            return None
        from xdist.scheduler import LoadFileScheduling

        class RayFilesTogether(LoadFileScheduling):
            def _split_scope(self, nodeid: str) -> str:
                file = super()._split_scope(nodeid)
                return "ray" if Path(file).name in RAY_FILES else file

        return RayFilesTogether(config, log)


def has_int4_kernel() -> bool:
    from specoffload.runtime.models.packed import int4_kernel_ok

    return int4_kernel_ok()


#: tests of int4 weights multiplied packed by torch's CPU int4 kernel: where this torch has none whose layout
#: `kernel_block` knows (AVX-512: 64-channel blocks, AVX2: 32), `int4_kernel_ok` is false and int4 / int8g / Q4
#: weights are held dequantized instead, which the other tests cover
needs_int4_kernel = pytest.mark.skipif(not has_int4_kernel(), reason="this torch has no CPU int4 kernel whose layout "
                                       "is known: int4 weights are held dequantized")


def other_cores_busy(monkeypatch: pytest.MonkeyPatch, cores: float = 1.0) -> Callable[[], tuple[float, float] | None]:
    """Other processes keep `cores` cores busy all the time (simulated in profiler.py's /proc/stat reading: every
    process's busy seconds are this process's own plus `cores` cores', whatever the machine's real others do: /proc/stat
    counts in 10 ms ticks, so over the few milliseconds a test's passes take, a real reading is noise; own CPU a tick
    ahead of the total once read 0.3 cores in CI, and the suite's other pytest-xdist worker is a real busy core), with
    the disturbance limit at 0.5 cores; `cores=0` simulates a quiet machine. Returns the real reading."""
    from specoffload.runtime.offload import profiler

    real = profiler._busy_seconds

    def busy() -> tuple[float, float] | None:
        now = real()
        return None if now is None else (now[1] + cores * time.monotonic(), now[1])  # own + `cores`, all the time

    monkeypatch.setattr(profiler, "_busy_seconds", busy)
    monkeypatch.setattr(profiler, "OTHERS_LIMIT", 0.5)
    return real


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> checkpoint dir: mixtral(_fused), qwen2_moe(_fused, _windowed), llama(_sharded, _tied),
    qwen2_draft, mistral. All share a 512-token vocabulary with bos 1 and eos 2."""
    from scripts.make_tiny_models import make_tiny_models  # imports transformers: only when a test needs models

    return make_tiny_models(tmp_path_factory.mktemp("tiny_models"))


#: prompts of different lengths on the tiny models' vocabulary, and greedy settings, that the offloaded-engine
#: tests compare against the resident engine
OFFLOAD_PROMPTS = [[1, 5 + i, 9, 33 + 2 * i, 70 + i][: 2 + i % 4] for i in range(7)]


def tight_config(target: str | Path, **kw):  # noqa: ANN003, ANN201
    """An offloaded EngineConfig of `target` at the smallest budget that places its plan (batch 3, k 3, one ring
    slot, so the tiny models stream their FFN parts); `kw` overrides any field."""
    from dataclasses import replace

    from specoffload.runtime.config import EngineConfig
    from specoffload.runtime.engine import Engine

    config = EngineConfig(**(dict(target=target, max_batch_size=3, max_seq_len=48, num_draft_tokens=3,
                                  device_memory="1GiB", num_buffers=1) | kw))
    probe = Engine(config)
    budget = probe.minimum_device_memory()
    probe.close()
    return replace(config, device_memory=budget)


def offload_greedy(config):  # noqa: ANN001, ANN201
    """Greedy tokens of OFFLOAD_PROMPTS (10 new tokens, EOS ignored, as `resident_greedy`) and the engine, which
    the caller closes."""
    from specoffload.runtime.engine import Engine
    from specoffload.runtime.sampling import SamplingParams

    engine = Engine(config)
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    return [r.token_ids for r in engine.generate(OFFLOAD_PROMPTS, params)], engine


@pytest.fixture(scope="session")
def resident_greedy(tiny_models):  # noqa: ANN001, ANN201
    """name -> greedy tokens of OFFLOAD_PROMPTS (10 new tokens, EOS ignored) from the resident Engine (batch 3)."""
    from specoffload.runtime.config import EngineConfig
    from specoffload.runtime.engine import Engine
    from specoffload.runtime.sampling import SamplingParams

    cache: dict[str, list[list[int]]] = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            engine = Engine(EngineConfig(tiny_models[name], max_batch_size=3))
            params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
            cache[name] = [r.token_ids for r in engine.generate(OFFLOAD_PROMPTS, params)]
        return cache[name]

    return get


@pytest.fixture
def single_thread() -> Iterator[None]:
    """Run a test with one torch thread: tiny-model tests are faster, and far less hurt by a busy machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True, scope="session")
def _profile_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Offloaded engines plan by default and cache measured hardware profiles: keep them out of ~/.cache. Other
    processes' load does not make a test's profile disturbed (a test that checks that sets its own limit)."""
    from specoffload.runtime.offload import profiler

    old = profiler.PROFILE_DIR, profiler.OTHERS_LIMIT
    profiler.PROFILE_DIR = tmp_path_factory.mktemp("profiles")
    profiler.OTHERS_LIMIT = float("inf")
    yield
    profiler.PROFILE_DIR, profiler.OTHERS_LIMIT = old


@pytest.fixture(autouse=True, scope="session")
def _kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Native kernels built for the tests (runtime/kernels) go to a temporary folder, not ~/.cache (the environment
    variable: subprocesses, Ray's workers included, build into the same folder)."""
    import os

    old = os.environ.get("SPECOFFLOAD_KERNEL_CACHE")
    os.environ["SPECOFFLOAD_KERNEL_CACHE"] = str(tmp_path_factory.mktemp("kernels"))
    yield
    if old is None:
        os.environ.pop("SPECOFFLOAD_KERNEL_CACHE", None)
    else:
        os.environ["SPECOFFLOAD_KERNEL_CACHE"] = old


@pytest.fixture(autouse=True, scope="session")
def _verified_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Checkpoints verified against their recorded hashes are remembered: keep that record out of ~/.cache."""
    from specoffload.runtime import hashing

    old = hashing.VERIFIED_CACHE
    hashing.VERIFIED_CACHE = tmp_path_factory.mktemp("verified") / "verified.json"
    yield
    hashing.VERIFIED_CACHE = old


def dense_shape(name: str, layers: int, attention: int, mlp: int, head: int, embedding: int, kv: int) -> ModelShape:
    """A synthetic dense model's parts for the planner's tests: bytes per embedding, per layer's attention and MLP,
    and the head; kv: KV-cache bytes per token."""
    parts: list[tuple[PartKey, int]] = [(PartKey("embedding"), embedding)]
    for j in range(layers):
        parts += [(PartKey("attention", j), attention), (PartKey("dense_mlp", j), mlp)]
    parts.append((PartKey("head"), head))
    return ModelShape(name, tuple(parts), layers, kv)
