"""What the benchmark scripts share: where results go, the page-cache drop, the result file, median and spread,
the plots' figure.

Only code that was the same in several scripts lives here (`timed_generate`: one timed generate call and the fields
every benchmark reports; each script adds its own through `extra`). The scripts' rooflines and machine descriptions
stay with them: they measure and record different things (memory bandwidth and GEMM rates per dtype in
bench_generate, cold O_DIRECT disk reads in bench_offload; each JSON keeps its own keys).
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from specoffload.runtime.offload.direct_io import drop_page_cache as drop_caches  # the one page-cache drop

ROOT = Path(__file__).resolve().parent.parent  # the repository
PERF = ROOT / "docs" / "perf"  # benchmark results: JSON per benchmark, sections of its README.md

__all__ = ["PERF", "ROOT", "drop_caches", "figure", "median_spread", "timed_generate", "timed_samples", "utc_now",
           "write_json"]


#: benchmark workload -> its prompts' source ("DATASET[:start:end]" of runtime/corpora.py, or "humaneval")
_WORKLOAD_SOURCES = {"summarization": "aclsum", "code": "humaneval", "chat": "sharegpt:0:400"}
WORKLOADS = tuple(_WORKLOAD_SOURCES)


def workload_prompts(workload: str) -> list[str]:
    """The prompt texts of a benchmark workload, in corpus order: "summarization" (aclsum papers), "code"
    (HumanEval), "chat" (ShareGPT's first human turns, the first 400 conversations)."""
    from specoffload.runtime.corpora import dataset_prompts
    from specoffload.runtime.prompts import humaneval_prompts

    if workload not in _WORKLOAD_SOURCES:
        raise SystemExit(f"unknown workload {workload!r}: one of {', '.join(WORKLOADS)}")
    source = _WORKLOAD_SOURCES[workload]
    return humaneval_prompts() if source == "humaneval" else dataset_prompts(source)


def utc_now() -> str:
    """The current UTC time as ISO 8601 to the second, e.g. ``2026-12-03T05:12:05+00:00``."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def machine() -> dict:
    """This machine for a benchmark's JSON: CPU model, its AVX / AMX / FMA / F16C flags, cores."""
    import os
    import platform

    cpu = {"model": platform.processor() or platform.machine(), "cores": os.cpu_count(), "flags": []}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu["model"] = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                cpu["flags"] = [f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma", "f16c"))]
                break
    except OSError:
        pass
    return cpu


def run_meta(dtype: str) -> dict:
    """What a benchmark JSON records about its run: `machine()`, torch version, dtype, commit (with "+dirty" when
    the tree has changes), full argv and time."""
    import subprocess
    import sys

    import torch

    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no")
                                                     else "")
    return {"machine": machine(), "torch": torch.__version__, "dtype": dtype, "commit": commit, "argv": sys.argv,
            "date": utc_now()}


def write_json(path: Path, data: object) -> Path:
    """Write ``data`` as indented JSON with a final newline, creating the folder; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def timed_generate(config: Any, prompts: list[list[int]], params: Any, plan: Any = None,
                   extra: Callable[[Any, float], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Build `Engine(config, plan=plan)`, time one `generate` call (loading excluded) and close the engine. Returns
    what the benchmarks share: wall_s, tokens, tok_s, passes, row_passes (rows summed over verified passes),
    committed_per_row_pass, acceptance (None without drafts), token_ids; and `extra(engine, start)`, a script's own
    fields read before the engine closes (its stats are `engine.last_stats`; start: perf_counter at the call)."""
    import time

    from specoffload.runtime.engine import Engine

    engine = Engine(config, plan=plan)
    try:
        start = time.perf_counter()
        results = engine.generate(prompts, params)
        wall = time.perf_counter() - start
        stats = engine.last_stats
        log = engine.pipeline.verify_log
        row_passes = sum(rows for *_, rows in log)
        out = {"wall_s": wall, "tokens": stats.generated_tokens, "tok_s": stats.generated_tokens / wall,
               "passes": getattr(stats, "passes", 0), "row_passes": row_passes,
               "committed_per_row_pass": stats.generated_tokens / row_passes if row_passes else None,
               "acceptance": stats.acceptance_rate if stats.num_drafted else None,
               "token_ids": [r.token_ids for r in results]}
        return out | (extra(engine, start) if extra is not None else {})
    finally:
        engine.close()


#: the trace's compute spans of a target pass (the loader's is "load")
COMPUTE_SPANS = ("attention", "ffn", "head")


def io_compute_seconds(engine: Any) -> tuple[float, float]:
    """(the loader's busy seconds, the pass's compute seconds: attention + ffn + head) summed over the engine's
    trace of its last generate call (config trace=True); (0, 0) without a trace."""
    spans = engine.tracer.spans if engine.tracer is not None else []
    by_name: dict[str, float] = {}
    for s in spans:
        by_name[s.name] = by_name.get(s.name, 0.0) + s.end - s.start
    return by_name.get("load", 0.0), sum(by_name.get(n, 0.0) for n in COMPUTE_SPANS)


def timed_samples(fn: Callable[[], object], reps: int) -> list[float]:
    """Seconds of `reps` calls of `fn` after one untimed warm-up call (perf_counter around each)."""
    import time

    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def median_spread(values: Iterable[float]) -> tuple[float, float, float]:
    """(median, min, max) of the repetitions' values: what every benchmark table reports."""
    xs = list(values)
    return statistics.median(xs), min(xs), max(xs)


@contextlib.contextmanager
def figure(path: Path, size: tuple[float, float], dpi: int = 120) -> Iterator[Any]:
    """One headless (Agg) matplotlib axes to draw on; on exit the figure is laid out, saved to ``path`` and
    closed (closed also when drawing fails)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    try:
        yield ax
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
