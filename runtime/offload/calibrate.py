"""Calibrate the cost model on measured passes: the pipeline's own stream rate and the per-pass overheads.

The profiler times each cost in isolation (a few layers streamed, one GEMM, one attention op, one draft step).
A real pass adds what no isolated timing holds: the loader converting fp16 -> fp32 on one thread while the compute
threads run (on a CPU-only machine they share the cores), the embedding, the head's output and the verification
per row, and the executor's hand-offs per op; and an isolated stream rate timed over a short burst follows the
disk's moment-to-moment rate (docs/perf/README.md, "Measurements behind the acceptance model and the stream
rate").

Here real passes run: one fixed-plan offloaded `Engine` without a drafter (built by the caller's `open_engine`: the
engine imports the profiler, so this module does not import the engine) under the profiled config's budget, on
synthetic prompts, with CALIBRATION_ROWS rows per pass in turn (the first, or the most that fit under it, is the
engine's batch; the others run fewer prompts through it). The profile is the model's, shared by every drafter, so
no drafter runs here: positions per pass vary with the rows, and a drafter's own cost is its measured draft step
(profiler.py `drafter_steps`). From the decode passes (the prefill ones skipped):

    stream rate   streamed bytes (compute dtype) / the load ops' busy seconds, over every timed pass: the rate the
                  io thread reaches beside the compute (replaces the isolated one when passes stream anything)
    overheads     per point, the overhead x that makes the model's step equal the measured pass period (bisection:
                  the step is non-decreasing in it; 0 when the model is already slower), then least squares
                  x = pass_overhead_s + position_overhead_s * positions verified (clipped at 0)

The points (measured and predicted periods, busy seconds per op kind) are kept in the profile (`calibration`).
"""

from __future__ import annotations

import gc
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from specoffload.planner import HardwareProfile
from specoffload.planner.cost import estimate_step, stream_bytes, stream_seconds
from specoffload.planner.placement import PlacementError

from ..config import EngineConfig
from ..sampling import SamplingParams

if TYPE_CHECKING:
    from ..engine import Engine

#: builds an engine for a config (`Engine` itself): the fixed-plan engines whose passes are timed
EngineFactory = Callable[[EngineConfig], "Engine"]

#: rows per pass of the calibration passes (the first is the engine's batch), synthetic prompt length, new tokens
CALIBRATION_ROWS = (16, 4)
PROMPT_TOKENS = 16
NEW_TOKENS = 8


def calibrate(config: EngineConfig, profile: HardwareProfile, open_engine: EngineFactory,
              quick: bool = False) -> HardwareProfile:
    """`profile` with the in-pass stream rate and the two overheads fitted on measured passes (module docstring),
    timed on engines built by `open_engine`. Without a device budget (nothing is offloaded) the profile is
    returned as it is."""
    if config.device_memory is None:
        return profile
    plain = replace(config, drafter="none", draft=None, draft_dtype=None, drafter_options={}, interleave=None)
    points = _run(plain, open_engine, CALIBRATION_ROWS, quick=quick)
    loaded = sum(p["streamed_bytes"] for p in points)
    busy = sum(p["load_s"] for p in points)
    # the loader's seconds the isolated rates predict for the same loads (compressed parts: read + decompression)
    modelled = sum(sum(stream_seconds(profile, p["placement"], p["costs"].target).values()) * p["loads"]
                   for p in points)
    dense = all(p["costs"].num_experts == 0 for p in points)  # (selected expert loading reads fewer bytes)
    factor = modelled / busy if dense and loaded > 0 and busy > 0 and modelled > 0 else 1.0
    calibrated = profile.scaled_io(factor)  # every loader rate (stream, read, decompress) by what passes show
    stream = calibrated.stream_bytes_per_s
    needed = [_overhead_needed(calibrated, p) for p in points]
    o, r = _fit_line([p["positions"] for p in points], needed)
    calibrated = replace(calibrated, pass_overhead_s=o, position_overhead_s=r)
    record = []
    for p, x in zip(points, needed):
        predicted = estimate_step(calibrated, p["costs"], p["placement"], p["rows"], p["k"], 0.0, p["attended_len"])
        isolated = estimate_step(profile, p["costs"], p["placement"], p["rows"], p["k"], 0.0, p["attended_len"])
        record.append({key: value for key, value in p.items() if key not in ("costs", "placement")}
                      | {"overhead_needed_s": x, "predicted_s": predicted.t_step, "bound": predicted.bound,
                         "predicted_isolated_s": isolated.t_step, "stream_isolated": profile.stream_bytes_per_s,
                         "stream_in_pass": stream})
    return replace(calibrated, calibration=tuple(record))


def _run(config: EngineConfig, open_engine: EngineFactory, row_counts: tuple[int, ...],
         quick: bool) -> list[dict[str, Any]]:
    """Time the decode passes of one fixed no-draft plan at each of `row_counts` rows per pass (the engine's batch is
    the first, halved until it fits the budget; a count above it is skipped)."""
    seq = PROMPT_TOKENS + NEW_TOKENS + 1
    rows = row_counts[0]
    while True:  # the most rows (halving) that fit the budget
        cfg = replace(config, max_batch_size=rows, num_draft_tokens=0, max_seq_len=seq, trace=True)
        try:
            engine = open_engine(cfg)  # a fixed plan (batch and k given): no profile needed
            break
        except PlacementError:
            if rows == 1:
                return []
            rows //= 2
    assert engine.placement is not None and engine.replanner is not None
    costs = engine.models.costs(engine.plan.drafting)
    batches = engine.plan.num_batches
    vocab = engine.target.config.vocab_size
    streamed = sum(stream_bytes(engine.placement, engine.models.target).values())
    out = []
    try:
        for count in sorted({min(rows, r) for r in row_counts}, reverse=True):
            prompts = [[(97 + 31 * i + 7 * t) % (vocab - 3) + 3 for t in range(PROMPT_TOKENS)]
                       for i in range(count * batches)]
            engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4 if quick else NEW_TOKENS,
                                                    ignore_eos=True))
            ends = [end for end, *_ in engine.pipeline.verify_log]
            skip = 2 * batches  # the prefill passes, and the first decode pass of each batch
            periods = [b - a for a, b in zip(ends[skip:], ends[skip + 1:])]
            if not periods:
                continue
            steps = sorted({s.args["step"] for s in engine.tracer.spans if s.name == "verify"})[skip + 1:]
            busy: dict[str, float] = defaultdict(float)
            for s in engine.tracer.spans:
                if s.args.get("step") in steps:
                    busy[s.name] += s.end - s.start
            timed = len(steps) or 1
            out.append({
                "rows": count, "k": 0, "positions": count, "attended_len": PROMPT_TOKENS + NEW_TOKENS // 2,
                "measured_s": statistics.median(periods), "passes": len(periods),
                "streamed_bytes": streamed * len(steps), "loads": len(steps), "load_s": busy["load"],
                **{f"{kind}_s": busy[kind] / timed for kind in ("attention", "ffn", "head", "verify", "embed")},
                "costs": costs, "placement": engine.placement,
            })
    finally:
        engine.close()
        del engine
        gc.collect()
    return out


def _overhead_needed(profile: HardwareProfile, point: dict[str, Any]) -> float:
    """The overhead per pass that makes the model's step equal the measured period (0 if it is already slower)."""
    def step(x: float) -> float:
        p = replace(profile, pass_overhead_s=x, position_overhead_s=0.0)
        return estimate_step(p, point["costs"], point["placement"], point["rows"], point["k"], 0.0,
                             point["attended_len"]).t_step

    target = point["measured_s"]
    if step(0.0) >= target:
        return 0.0
    return solve_nondecreasing(step, target, 0.0, target, 40)


def solve_nondecreasing(f: Callable[[float], float], target: float, lo: float, hi: float, steps: int) -> float:
    """The x in [lo, hi] where a non-decreasing f reaches `target`, by `steps` bisections (the midpoint of the last
    bracket); also replan.py `check_profile`'s compute scale."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares y = a + b x with a, b >= 0 (b = 0 and a = mean when the slope would be negative)."""
    if not xs:
        return 0.0, 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    if b <= 0:
        return max(0.0, my), 0.0
    a = my - b * mx
    if a < 0:  # through the origin
        return 0.0, max(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
    return a, b
