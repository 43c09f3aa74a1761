"""Measure the planner's `HardwareProfile` on this machine for one target model, and cache it by fingerprint.

One profile per machine, model, dtype, weights tier and format (`fingerprint`), shared by every drafter; each
drafter's own cost, its draft step, is measured on top of it and cached beside it (`drafter_steps`).

Every number is timed here, none is typed in (`measure`): weight streaming into ring slots (from disk with O_DIRECT,
or from the host-RAM tier), split into the read rate and the decompression / conversion rate of compressed or
converted weights; the device GEMM rate at the target's FFN shape versus rows, streamed (as the slots hold it: int8 /
int4 codes multiplied by their kernels with packed slots) and resident (oneDNN's packed layout);
CPU attention time versus new tokens x attended length (least-squares fit of c0 + c1 n + c2 n ctx); the head's
GEMM rate; beside a GPU, the host <-> device copy of hidden states versus rows. Then real no-draft passes on an
engine the caller builds (`open_engine`: this module never imports the engine) calibrate the stream rate and the
per-pass overheads (calibrate.py).

Conditions. Each rate is the median of REPS timings, whose spread (their range without the fastest and the slowest,
over the median) is recorded; so is the load other processes put on the machine meanwhile (busy CPU seconds from
/proc/stat minus this process's own, per second: `others_cores`). A measurement is disturbed when others_cores >
OTHERS_LIMIT or the spread of a timing of at least SPREAD_MIN_S > SPREAD_LIMIT. The isolated rates (seconds) are
taken again while disturbed, up to MEASURE_TRIES times, then the calibration passes (most of the time) run once; a
profile still disturbed is used for the job at hand, saved with the reason, and measured again by the next
`load_or_measure`. A job whose passes the
profile mispredicts by more than a margin marks it stale the same way (`mark_stale`, replan.py `check_profile`).

A profile is saved as JSON with its provenance and conditions under `~/.cache/specoffload/profiles/` and reused
while the fingerprint (machine, CPU, cores, torch, threads, device, model, dtype, weights tier, format, packed slots,
profiler version) matches and it is neither disturbed nor stale.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from specoffload.planner.profile import HardwareProfile, ProfileError, check_points
from specoffload.planner.shapes import PartKey

from ..config import EngineConfig
from ..models import layers
from ..models.linear import can_pack, pack_weights
from ..models.model import Transformer
from ..models.quantized import read_manifest
from .calibrate import EngineFactory, calibrate
from .direct_io import drop_page_cache
from .streamer import WeightStreamer

PROFILE_DIR = Path(os.environ.get("SPECOFFLOAD_CACHE", Path.home() / ".cache" / "specoffload")) / "profiles"
FFN_ROWS = (1, 4, 16, 64, 256)
DRAFT_ROWS = (1, 4, 16, 64)
DRAFT_CONTEXT = 64  # positions a timed draft step attends to
# 4: the loader converts float16 -> bfloat16 through float32 blocks (runtime/cast.py); 5: one profile per model
# shared by the drafters (their steps on top), no-draft calibration at several row counts, conditions recorded; 6: a
# timed draft step feeds a valid token per row (before, rows of no valid token skipped their FFN: steps 4-5x short).
# Bumping it re-measures every cached profile
PROFILER_VERSION = 6
ATTENTION_POINTS = ((1, 1, 64), (4, 4, 64), (16, 4, 64), (16, 4, 512), (64, 4, 256), (4, 4, 1024), (32, 32, 32))
#: a measurement is disturbed when other processes kept more than this many cores busy while it ran ...
OTHERS_LIMIT = 0.25
#: ... or a timing of at least SPREAD_MIN_S seconds varied by more than SPREAD_LIMIT ((max - min) / median)
SPREAD_LIMIT = 0.25
SPREAD_MIN_S = 2e-3
#: measurements of the isolated rates taken at most before a disturbed one is used as it is
MEASURE_TRIES = 3
#: timings per rate (the median is used); 1 when quick
REPS = 5
#: the draft step of a drafter that has no model to time (model-free, or none)
NOMINAL_DRAFT_STEP = ((1, 1e-3),)


def fingerprint(config: EngineConfig) -> dict[str, str | int]:
    """What a profile depends on: when any of it changes, the profile is measured again. The drafter is not in it:
    its step is measured on top (`drafter_steps`)."""
    cpu = platform.processor()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    return {
        "machine": platform.machine(), "cpu": cpu, "cores": os.cpu_count() or 1, "torch": torch.__version__,
        "device": torch.device(config.device).type, "target": Path(config.target).name,
        "format": weights_format(config.target), "dtype": config.dtype, "weights_tier": config.weights_tier,
        "threads": torch.get_num_threads(), "packed": config.packed_slots, "profiler": PROFILER_VERSION,
    }


def weights_format(target: str | Path) -> str:
    """The stored format of a checkpoint's weights: its compression scheme and group ("int8/g0"), or "as stored"."""
    manifest = read_manifest(Path(target))
    return "as stored" if manifest is None else f"{manifest.spec.name}/g{manifest.spec.group}"


def draft_key(config: EngineConfig) -> str:
    """What a drafter's measured step depends on (its class's `profile_key`, and the draft's dtype); "" for none."""
    key = config.drafter_class.profile_key(config)
    return f"{key}/{config.draft_dtype or config.dtype}" if key else ""


def profile_path(config: EngineConfig) -> Path:
    key = hashlib.sha256(json.dumps(fingerprint(config), sort_keys=True).encode()).hexdigest()[:16]
    return PROFILE_DIR / f"{Path(config.target).name}-{key}.json"


def _drafts_path(config: EngineConfig) -> Path:
    path = profile_path(config)
    return path.with_name(path.stem + ".drafts.json")


def cached(config: EngineConfig) -> tuple[HardwareProfile | None, str | None]:
    """The cached profile for `config`'s fingerprint, or None with why it is not usable (None: nothing cached)."""
    path = profile_path(config)
    if not path.exists():
        return None, None
    try:
        profile = HardwareProfile.load(path)
    except ProfileError as exc:
        return None, str(exc)
    if not profile.matches(fingerprint(config)):
        return None, "its fingerprint differs"
    conditions = profile.provenance.get("conditions") or {}
    if conditions.get("stale"):
        return None, f"marked stale: {conditions['stale']}"
    if conditions.get("disturbed"):
        return None, f"it was measured on a busy machine ({conditions['disturbed']})"
    return profile, None


def load_or_measure(config: EngineConfig, *, open_engine: EngineFactory, quick: bool = False,
                    log: Callable[[str], None] | None = None) -> HardwareProfile:
    """The profile for `config`'s model (cached, or measured and saved for next time) with `config`'s drafter's
    step on top (`drafter_steps`); `open_engine`: as for `measure`. log: a line per phase, with its ETA."""
    say = log or (lambda _: None)
    profile, why = cached(config)
    if profile is None:
        path = profile_path(config)
        say(f"profile: measuring the hardware profile of {Path(config.target).name} "
            f"({'again: ' + why if why else 'cached afterwards'}; in {path})")
        profile = measure(config, quick=quick, open_engine=open_engine, log=say)
        path.parent.mkdir(parents=True, exist_ok=True)
        profile.save(path)
        _drafts_path(config).unlink(missing_ok=True)  # steps measured beside the old profile are remeasured
    return replace(profile, draft_step_s=drafter_steps(config, quick=quick, log=say))


def drafter_steps(config: EngineConfig, quick: bool = False,
                  log: Callable[[str], None] | None = None) -> tuple[tuple[int, float], ...]:
    """`config`'s drafter's step versus rows (`HardwareProfile.draft_step_s`): cached beside the profile by
    `draft_key`, else measured on the model its class names (`step_model`) and cached; NOMINAL_DRAFT_STEP for a
    drafter with no model to time (none, or a model-free one)."""
    key = draft_key(config)
    if not key or config.drafter_class.model_free:
        return NOMINAL_DRAFT_STEP
    path = _drafts_path(config)
    steps: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        loaded = json.loads(path.read_text())
        steps = loaded if isinstance(loaded, dict) else {}
    if key in steps:
        with contextlib.suppress(ProfileError):  # (a damaged entry is measured again)
            return check_points("draft_step_s", steps[key])
    if log:
        log(f"profile: timing the draft step of {config.drafter_name!r}")
    with torch.inference_mode():
        measured = _draft_steps(config, _Timer(1 if quick else 3), quick)
    steps[key] = [list(p) for p in measured]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(steps, indent=2) + "\n")
    return measured


def mark_stale(config: EngineConfig, why: str) -> None:
    """Mark the cached profile stale (`why`: a job found it off, or a user asked): the next `load_or_measure`
    measures it again."""
    path = profile_path(config)
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(path.read_text())
        data["provenance"].setdefault("conditions", {})["stale"] = why
        path.write_text(json.dumps(data, indent=2) + "\n")


def _sync() -> None:
    """Wait for queued GPU work (CUDA kernels and copies are asynchronous; nothing to wait for on the CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@dataclass
class _Timer:
    """Times a function `reps` times after a warm-up: the median, and the spread of each timing it took (the range
    of the samples without the fastest and the slowest, over the median, from 5 samples on; the whole range below)."""

    reps: int
    spreads: dict[str, float] = field(default_factory=dict)  # what -> spread, for timings >= SPREAD_MIN_S

    def __call__(self, fn: Callable[[], object], what: str) -> float:
        fn()  # warm-up
        _sync()
        samples = []
        for _ in range(self.reps):
            t = time.perf_counter()
            fn()
            _sync()
            samples.append(time.perf_counter() - t)
        median = statistics.median(samples)
        kept = sorted(samples)[1:-1] if len(samples) >= 5 else samples
        if len(samples) > 1 and median >= SPREAD_MIN_S:
            self.spreads[what] = (max(kept) - min(kept)) / median
        return median


def _busy_seconds() -> tuple[float, float] | None:
    """(CPU seconds every process has been busy since boot (/proc/stat), this process's own CPU seconds); None
    where /proc/stat cannot be read."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in (fields[1:9] + ["0"] * 8)[:8])
    own = os.times()
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), own.user + own.system


BusyMark = tuple[float, float, float]  # (`_busy_seconds`, monotonic seconds)


def busy_mark() -> BusyMark | None:
    """`_busy_seconds` with the monotonic time it was read at; None where /proc/stat cannot be read."""
    busy = _busy_seconds()
    return None if busy is None else (*busy, time.monotonic())


def others_cores(start: BusyMark | None, end: BusyMark | None) -> float | None:
    """Cores other processes kept busy between two `busy_mark`s: (busy - own CPU seconds) / wall seconds (None:
    unknown)."""
    if start is None or end is None or end[2] <= start[2]:
        return None
    return max(0.0, (end[0] - start[0]) - (end[1] - start[1])) / (end[2] - start[2])


class _Others:
    """Cores other processes kept busy over a `with` block (`others_cores`; None: unknown)."""

    def __enter__(self) -> _Others:
        self.start, self.cores = busy_mark(), None
        return self

    def __exit__(self, *exc: object) -> None:
        self.cores: float | None = others_cores(self.start, busy_mark())


def disturbed(conditions: dict[str, Any]) -> str | None:
    """Why a measurement's conditions say it was disturbed (module docstring), or None."""
    others, spread = conditions.get("others_cores"), conditions.get("spread")
    if others is not None and others > OTHERS_LIMIT:
        return f"other processes kept {others:.2f} cores busy (limit {OTHERS_LIMIT})"
    if spread is not None and spread > SPREAD_LIMIT:
        return f"{conditions.get('spread_of')} varied by {spread:.0%} between repetitions (limit {SPREAD_LIMIT:.0%})"
    return None


#: the phases of a measurement and their rough shares of its time (for the ETA of its progress lines)
PHASES = (("stream rate", 0.05), ("FFN GEMM rates", 0.1), ("attention", 0.05), ("head", 0.05),
          ("calibration passes", 0.75))


class _Phases:
    """Says `profile: i/n <phase> (elapsed, ETA)` as each phase of a measurement starts (a phase taken again counts
    its share again)."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log, self.attempt, self.start, self.done = log, 1, time.monotonic(), 0.0

    def __call__(self, i: int) -> None:
        name, share = PHASES[i]
        elapsed = time.monotonic() - self.start
        eta = f", about {elapsed * (1 - self.done) / self.done:.0f} s left" if self.done > 0 else ""
        again = f" (try {self.attempt})" if self.attempt > 1 else ""
        self.log(f"profile: {i + 1}/{len(PHASES)} {name}{again} ({elapsed:.0f} s{eta})")
        self.done = min(0.95, self.done + share)


def measure(config: EngineConfig, *, open_engine: EngineFactory, quick: bool = False,
            log: Callable[[str], None] | None = None) -> HardwareProfile:
    """Time every cost the planner models (module docstring): the isolated rates, again while disturbed (at most
    MEASURE_TRIES times), then the calibration passes. quick: fewer points and repetitions. open_engine: builds the
    engine whose passes calibrate the profile (calibrate.py; the caller passes `Engine`: this module sits below the
    engine and never imports it)."""
    say = log or (lambda _: None)
    phase = _Phases(say)
    for attempt in range(1, MEASURE_TRIES + 1):
        phase.attempt = attempt
        isolated = _isolated(config, quick, phase)
        why = disturbed(isolated.provenance["conditions"])
        if why is None:
            break
        if attempt < MEASURE_TRIES:
            say(f"profile: the measurement was disturbed ({why}): measuring again")
    conditions = dict(isolated.provenance["conditions"])
    phase.attempt = 1  # (the calibration runs once)
    phase(len(PHASES) - 1)
    with _Others() as others:
        profile = calibrate(config, isolated, open_engine, quick=quick)
    if others.cores is not None:  # the busier of the two spans
        conditions["others_cores"] = max(others.cores, conditions["others_cores"] or 0.0)
    why = disturbed(conditions)
    if why is not None:
        say(f"profile: disturbed ({why}): used for this job as measured, measured again next time")
        conditions["disturbed"] = why
    return replace(profile, provenance=dict(profile.provenance) | {"conditions": conditions})


def _isolated(config: EngineConfig, quick: bool, phase: Callable[[int], None]) -> HardwareProfile:
    """The isolated rates (module docstring), uncalibrated, their conditions in the provenance."""
    timer = _Timer(1 if quick else REPS)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    dtype, device = config.torch_dtype, torch.device(config.device)
    target = Transformer(config.target, dtype=dtype, device=device, packed=config.packed_resident)
    target.pack = False  # streamed weights are used unpacked
    cfg = target.config
    with torch.inference_mode(), _Others() as others:
        phase(0)
        stream, read_rate, decompress_rate = _stream_rate(config, target, layers_to_load=2 if quick else 6)
        phase(1)
        ffn_key = PartKey("expert", 0, 0) if cfg.is_moe_layer(0) else PartKey("dense_mlp", 0)
        ffn_w = target.loader.load(ffn_key)
        mlp = ffn_w if ffn_key.kind == "expert" else ffn_w.mlp
        params = mlp.gate.numel() + mlp.up.numel() + mlp.down.numel()
        packs = can_pack(dtype, device)
        # Streamed weights are used as the slot holds them (as read, or int8 / int4 codes for a kernel: packed
        # slots); resident ones are kept in oneDNN's packed layout (models/linear.py).
        streamed, slots = _streamed_mlp(config, target, ffn_key)
        packed = pack_weights(mlp) if packs else None
        ffn_rates, resident_rates = [], []
        for rows in FFN_ROWS[:3] if quick else FFN_ROWS:
            x = torch.randn(rows, 1, cfg.hidden_size, dtype=dtype, device=device)
            seconds = timer(lambda x=x, mlp=streamed or mlp: layers.expert_mlp(cfg, x, mlp),
                            f"FFN at {rows} rows")
            ffn_rates.append((rows, 2 * params * rows / seconds))
            if packed is not None:
                seconds = timer(lambda x=x, mlp=packed: layers.expert_mlp(cfg, x, mlp),
                                f"resident FFN at {rows} rows")
                resident_rates.append((rows, 2 * params * rows / seconds))
        if slots is not None:
            slots.close()
        del ffn_w, mlp, packed, streamed
        phase(2)
        # attention runs where the attention worker runs it: on the host beside a GPU (host_attention)
        host = Transformer(config.target, dtype=dtype, device="cpu") if config.host_attention else target
        attention = _attention_fit(host, timer, quick)
        phase(3)
        head = target.loader.load(PartKey("head"))
        head = pack_weights(head) if packs else head  # the head is placed resident first (placement.py)
        x = torch.randn(16, 1, cfg.hidden_size, dtype=dtype, device=device)
        head_rate = 2 * head.lm_head.numel() * 16 / timer(lambda h=head: layers.head_logits(cfg, h, x), "head")
        del head
        link = _hidden_link_fit(cfg.hidden_size, dtype, device, timer) if config.host_attention else None
    worst = max(timer.spreads.items(), key=lambda kv: kv[1], default=(None, None))
    conditions = {"others_cores": others.cores, "loadavg_1m": load, "spread": worst[1], "spread_of": worst[0],
                  "reps": timer.reps, "spreads": timer.spreads}
    provenance = fingerprint(config) | {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "quick": quick,
        "tool": "specoffload.runtime.offload.profiler", "conditions": conditions,
    }
    return HardwareProfile(
        provenance=provenance,
        device=device.type,
        shared_compute=device.type == "cpu",
        weights_tier=config.weights_tier,
        stream_bytes_per_s=stream,
        ffn_flops_per_s=tuple(ffn_rates),
        attention_fit=attention,
        draft_step_s=NOMINAL_DRAFT_STEP,
        head_flops_per_s=head_rate,
        resident_ffn_flops_per_s=tuple(resident_rates) or None,
        pass_overhead_s=0.0,
        read_bytes_per_s=read_rate,
        decompress_bytes_per_s=decompress_rate,
        hidden_link_fit=link,
    )


def _slot_bytes(target: Transformer, groups: list[list[PartKey]], packed: bool) -> int:
    """Bytes a ring slot needs for the largest group of parts (a probe streamer: it allocates no slot)."""
    with WeightStreamer(target.loader, 1, 1, "disk", target.device, staging_bytes=4 * 4096, packed=packed) as probe:
        return max(probe.nbytes(g) for g in groups)


def _streamed_mlp(config: EngineConfig, target: Transformer, key: PartKey) -> tuple[Any, WeightStreamer | None]:
    """The FFN part as a ring slot holds it when the slots keep some of its weights packed (int8 / int4 codes the
    layers multiply by a kernel: it takes fewer slot bytes, as `ModelShape.slotted` counts it), with the streamer
    that holds it (close it after use); (None, None) otherwise: the loader's compute-dtype weights are what the slot
    holds."""
    if not config.packed_slots or target.loader.packed_nbytes(key) >= target.loader.nbytes(key):
        return None, None
    streamer = WeightStreamer(target.loader, _slot_bytes(target, [[key]], True), 1, "disk", target.device,
                              parts=[key], packed=True)
    part = streamer.load(0, [key])[key]
    return (part if key.kind == "expert" else part.mlp), streamer


#: rows of hidden states the host <-> device copy fit is timed at (a decode pass's and a prefill chunk's sizes)
LINK_ROWS = (16, 4096)


def _hidden_link_fit(hidden: int, dtype: torch.dtype, device: torch.device,
                     timer: _Timer) -> tuple[float, float] | None:
    """(a, b) of a pinned host <-> device copy of hidden states, seconds = a + b * bytes: the mean of the two
    directions, fitted through LINK_ROWS rows. None off CUDA (host attention on the CPU itself copies nothing)."""
    if device.type != "cuda":
        return None
    points = []
    for rows in LINK_ROWS:
        host = torch.empty(rows, hidden, dtype=dtype).pin_memory()
        dev = torch.empty(rows, hidden, dtype=dtype, device=device)
        there = timer(lambda d=dev, h=host: d.copy_(h, non_blocking=True), f"copy of {rows} rows to the device")
        back = timer(lambda d=dev, h=host: h.copy_(d, non_blocking=True), f"copy of {rows} rows to the host")
        points.append((host.numel() * host.element_size(), (there + back) / 2))
    (x0, y0), (x1, y1) = points
    b = max(0.0, (y1 - y0) / (x1 - x0))
    return max(0.0, y0 - b * x0), b


def _stream_rate(config: EngineConfig, target: Transformer,
                 layers_to_load: int) -> tuple[float, float | None, float | None]:
    """Bytes per second delivered into two ring slots, loading FFN layers as the pipeline does; for a compressed
    checkpoint also the loader's raw read rate (stored bytes per second of reading; None from the RAM tier) and
    its decompression rate (compute-dtype bytes written per second of dequantizing)."""
    cfg = target.config
    groups = []
    for layer in range(min(layers_to_load, cfg.num_layers)):
        if cfg.is_moe_layer(layer):
            groups.append([PartKey("router", layer)] + [PartKey("expert", layer, e) for e in range(cfg.num_experts)])
        else:
            groups.append([PartKey("dense_mlp", layer)])
    parts = [k for g in groups for k in g]
    packed = config.packed_slots
    slot_bytes = _slot_bytes(target, groups, packed)
    drop_page_cache()
    streamer = WeightStreamer(target.loader, slot_bytes, 2, config.weights_tier, target.device, parts=parts,
                              packed=packed)
    try:
        t = time.perf_counter()
        moved = 0
        for n, group in enumerate(groups):
            streamer.load(n % 2, group)
            moved += streamer.nbytes(group)
        _sync()  # (on CUDA a load only queues its copies)
        stream = moved / (time.perf_counter() - t)
        decompressed = sum(f.nbytes for key in parts for f in streamer.layout(key).fields if f.quant is not None)
        if not decompressed or streamer.decompress_seconds <= 0:
            return stream, None, None
        read = None
        if config.weights_tier == "disk" and streamer.read_seconds > 0:
            read = streamer.bytes_read / streamer.read_seconds
        return stream, read, decompressed / streamer.decompress_seconds
    finally:
        streamer.close()


def _attention_fit(target: Transformer, timer: _Timer, quick: bool) -> tuple[float, float, float]:
    """Least-squares c0 + c1 n + c2 n ctx (seconds per layer) over (rows, tokens, attended length ctx) points."""
    target.pack = True  # resident attention weights are packed (as the engine keeps them)
    cfg = target.config
    rows_x, ys = [], []
    points = ATTENTION_POINTS[:4] if quick else ATTENTION_POINTS
    for rows, tokens, ctx in points:
        cache = target.new_cache(rows, ctx + tokens, growable=False)
        cache.advance(torch.full((rows,), ctx, dtype=torch.long))
        x = torch.randn(rows, tokens, cfg.hidden_size, dtype=target.dtype, device=target.device)
        seconds = timer(lambda x=x, cache=cache: target.attention(0, x, cache),
                        f"attention of {rows} x {tokens} tokens over {ctx}")
        n = rows * tokens
        rows_x.append([1.0, float(n), float(n * ctx)])
        ys.append(seconds)
    a = torch.tensor(rows_x, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)[:, None]
    scale = a.abs().max(dim=0).values  # conditioning
    coef = torch.linalg.lstsq(a / scale, y).solution[:, 0] / scale
    return tuple(max(0.0, float(c)) for c in coef)  # type: ignore[return-value]


def _draft_steps(config: EngineConfig, timer: _Timer, quick: bool) -> tuple[tuple[int, float], ...]:
    """One draft token step versus rows, on the model the drafter's class names (`step_model`: the draft model,
    or the target with only its resident experts); a drafter with no model to time: NOMINAL_DRAFT_STEP."""
    stepped = config.drafter_class.step_model(config)
    if stepped is None:
        return NOMINAL_DRAFT_STEP
    draft, allowed = stepped
    out = []
    for rows in DRAFT_ROWS[:3] if quick else DRAFT_ROWS:
        cache = draft.new_cache(rows, 80, growable=False)
        context = torch.full((rows,), DRAFT_CONTEXT, dtype=torch.long)
        cache.advance(context)
        ids = torch.ones(rows, 1, dtype=torch.long)
        last = torch.zeros(rows, 1, dtype=torch.long)

        def step(cache=cache, ids=ids, last=last, context=context) -> None:
            # one valid token per row (every layer computes it: a row with no valid token skips its FFN), then the
            # cache back to its context, so that every repetition attends to the same positions
            draft.forward(ids, cache, num_new=torch.ones(ids.shape[0], dtype=torch.long), output_positions=last,
                          allowed_experts=allowed)
            cache.truncate(context)

        out.append((rows, timer(step, f"draft step at {rows} rows")))
    return tuple(out)
