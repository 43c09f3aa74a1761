"""Measure the planner's `HardwareProfile` on this machine for one model pair, and cache it by fingerprint.

Every number is timed here, none is typed in (`measure`): weight streaming into ring slots (from disk with O_DIRECT,
or from the host-RAM tier), split into the read rate and the decompression / conversion rate of compressed or
converted weights; the device GEMM rate at the target's FFN shape versus rows, streamed and resident (packed);
CPU attention time versus new tokens x attended length (least-squares fit of c0 + c1 n + c2 n ctx); the head's
GEMM rate; one draft token step versus rows (the drafter class's `step_model`); beside a GPU, the host <-> device
copy of hidden states versus rows. Then real passes on engines the caller builds (`open_engine`: this module never
imports the engine) calibrate the stream rate and the per-pass overheads (calibrate.py). A profile is saved as JSON
with its provenance under `~/.cache/specoffload/profiles/` and reused while the fingerprint (machine, CPU, cores,
torch, threads, device, models, drafter, dtype, weights tier, packed slots, profiler version) matches.
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
from datetime import datetime, timezone
from pathlib import Path

import torch

from specoffload.planner.profile import HardwareProfile
from specoffload.planner.shapes import PartKey

from ..config import EngineConfig
from ..models import layers
from ..models.linear import can_pack, pack_weights
from ..models.model import Transformer
from .calibrate import EngineFactory, calibrate
from .direct_io import drop_page_cache
from .streamer import WeightStreamer

PROFILE_DIR = Path(os.environ.get("SPECOFFLOAD_CACHE", Path.home() / ".cache" / "specoffload")) / "profiles"
FFN_ROWS = (1, 4, 16, 64, 256)
DRAFT_ROWS = (1, 4, 16, 64)
# 2: resident (packed) GEMM rates; 3: calibrated on measured passes (calibrate.py); 4: the loader converts float16
# -> bfloat16 through float32 blocks (runtime/cast.py, 3x its rate). Bumping it re-measures every
# cached profile
PROFILER_VERSION = 4
ATTENTION_POINTS = ((1, 1, 64), (4, 4, 64), (16, 4, 64), (16, 4, 512), (64, 4, 256), (4, 4, 1024), (32, 32, 32))


def fingerprint(config: EngineConfig) -> dict[str, str | int]:
    """What a profile depends on: when any of it changes, the profile is measured again."""
    cpu = platform.processor()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    return {
        "machine": platform.machine(), "cpu": cpu, "cores": os.cpu_count() or 1, "torch": torch.__version__,
        "device": torch.device(config.device).type, "target": Path(config.target).name,
        "draft": _draft_name(config), "dtype": config.dtype if not config.draft_dtype else
        f"{config.dtype}/{config.draft_dtype}",
        "weights_tier": config.weights_tier, "threads": torch.get_num_threads(), "packed": config.packed_slots,
        "profiler": PROFILER_VERSION,
    }


def _draft_name(config: EngineConfig) -> str:
    return config.drafter_class.profile_key(config)


def profile_path(config: EngineConfig) -> Path:
    key = hashlib.sha256(json.dumps(fingerprint(config), sort_keys=True).encode()).hexdigest()[:16]
    return PROFILE_DIR / f"{Path(config.target).name}-{key}.json"


def load_or_measure(config: EngineConfig, *, open_engine: EngineFactory, quick: bool = False,
                    log: Callable[[str], None] | None = None) -> HardwareProfile:
    """The cached profile for this fingerprint, or a fresh measurement (saved for next time); `open_engine`: as
    for `measure`."""
    path = profile_path(config)
    if path.exists():
        try:
            profile = HardwareProfile.load(path)
            if profile.matches(fingerprint(config)):
                return profile
        except Exception:  # noqa: BLE001 - an unreadable cache entry is measured again
            pass
    if log:
        log(f"measuring the hardware profile (cached afterwards in {path})")
    profile = measure(config, quick=quick, open_engine=open_engine)
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    return profile


def _sync() -> None:
    """Wait for queued GPU work (CUDA kernels and copies are asynchronous; nothing to wait for on the CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _time(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up
    _sync()
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        _sync()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def measure(config: EngineConfig, *, open_engine: EngineFactory, quick: bool = False) -> HardwareProfile:
    """Time every cost the planner models (module docstring). quick: fewer points and repetitions. open_engine:
    builds the engines whose passes calibrate the profile (calibrate.py; the caller passes `Engine`: this module
    sits below the engine and never imports it)."""
    reps = 1 if quick else 3
    dtype, device = config.torch_dtype, torch.device(config.device)
    target = Transformer(config.target, dtype=dtype, device=device)
    target.pack = False  # streamed weights are used unpacked
    cfg = target.config
    with torch.inference_mode():
        stream, read_rate, decompress_rate = _stream_rate(config, target, layers_to_load=2 if quick else 6)
        ffn_key = PartKey("expert", 0, 0) if cfg.is_moe_layer(0) else PartKey("dense_mlp", 0)
        ffn_w = target.loader.load(ffn_key)
        mlp = ffn_w if ffn_key.kind == "expert" else ffn_w.mlp
        params = mlp.gate.numel() + mlp.up.numel() + mlp.down.numel()
        packs = can_pack(dtype, device)
        # Streamed weights are used as read (unpacked); resident ones are kept packed (models/linear.py).
        packed = pack_weights(mlp) if packs else None
        ffn_rates, resident_rates = [], []
        for rows in FFN_ROWS[:3] if quick else FFN_ROWS:
            x = torch.randn(rows, 1, cfg.hidden_size, dtype=dtype, device=device)
            seconds = _time(lambda x=x, mlp=mlp: layers.gated_mlp(x, mlp, cfg.hidden_act), reps)
            ffn_rates.append((rows, 2 * params * rows / seconds))
            if packed is not None:
                seconds = _time(lambda x=x, mlp=packed: layers.gated_mlp(x, mlp, cfg.hidden_act), reps)
                resident_rates.append((rows, 2 * params * rows / seconds))
        del ffn_w, mlp, packed
        # attention runs where the attention worker runs it: on the host beside a GPU (host_attention)
        host = Transformer(config.target, dtype=dtype, device="cpu") if config.host_attention else target
        attention = _attention_fit(host, reps, quick)
        head = target.loader.load(PartKey("head"))
        head = pack_weights(head) if packs else head  # the head is placed resident first (placement.py)
        x = torch.randn(16, 1, cfg.hidden_size, dtype=dtype, device=device)
        head_rate = 2 * head.lm_head.numel() * 16 / _time(lambda h=head: layers.head_logits(cfg, h, x), reps)
        del head
        draft_steps = _draft_steps(config, reps, quick)
        link = _hidden_link_fit(cfg.hidden_size, dtype, device, reps) if config.host_attention else None
    provenance = fingerprint(config) | {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "quick": quick,
        "tool": "specoffload.runtime.offload.profiler",
    }
    return calibrate(config, HardwareProfile(
        provenance=provenance,
        device=device.type,
        shared_compute=device.type == "cpu",
        weights_tier=config.weights_tier,
        stream_bytes_per_s=stream,
        ffn_flops_per_s=tuple(ffn_rates),
        attention_fit=attention,
        draft_step_s=draft_steps,
        head_flops_per_s=head_rate,
        resident_ffn_flops_per_s=tuple(resident_rates) or None,
        pass_overhead_s=0.0,
        read_bytes_per_s=read_rate,
        decompress_bytes_per_s=decompress_rate,
        hidden_link_fit=link,
    ), open_engine, quick=quick)


#: rows of hidden states the host <-> device copy fit is timed at (a decode pass's and a prefill chunk's sizes)
LINK_ROWS = (16, 4096)


def _hidden_link_fit(hidden: int, dtype: torch.dtype, device: torch.device,
                     reps: int) -> tuple[float, float] | None:
    """(a, b) of a pinned host <-> device copy of hidden states, seconds = a + b * bytes: the mean of the two
    directions, fitted through LINK_ROWS rows. None off CUDA (host attention on the CPU itself copies nothing)."""
    if device.type != "cuda":
        return None
    points = []
    for rows in LINK_ROWS:
        host = torch.empty(rows, hidden, dtype=dtype).pin_memory()
        dev = torch.empty(rows, hidden, dtype=dtype, device=device)
        there = _time(lambda d=dev, h=host: d.copy_(h, non_blocking=True), reps)
        back = _time(lambda d=dev, h=host: h.copy_(d, non_blocking=True), reps)
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
    probe = WeightStreamer(target.loader, 1, 1, "disk", target.device, staging_bytes=4 * 4096, packed=packed)
    slot_bytes = max(probe.nbytes(g) for g in groups)
    probe.close()
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


def _attention_fit(target: Transformer, reps: int, quick: bool) -> tuple[float, float, float]:
    """Least-squares c0 + c1 n + c2 n ctx (seconds per layer) over (rows, tokens, attended length ctx) points."""
    target.pack = True  # resident attention weights are packed (as the engine keeps them)
    cfg = target.config
    rows_x, ys = [], []
    points = ATTENTION_POINTS[:4] if quick else ATTENTION_POINTS
    for rows, tokens, ctx in points:
        cache = target.new_cache(rows, ctx + tokens, growable=False)
        cache.advance(torch.full((rows,), ctx, dtype=torch.long))
        x = torch.randn(rows, tokens, cfg.hidden_size, dtype=target.dtype, device=target.device)
        seconds = _time(lambda x=x, cache=cache: target.attention(0, x, cache), reps)
        n = rows * tokens
        rows_x.append([1.0, float(n), float(n * ctx)])
        ys.append(seconds)
    a = torch.tensor(rows_x, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)[:, None]
    scale = a.abs().max(dim=0).values  # conditioning
    coef = torch.linalg.lstsq(a / scale, y).solution[:, 0] / scale
    return tuple(max(0.0, float(c)) for c in coef)  # type: ignore[return-value]


def measure_draft_steps(config: EngineConfig, quick: bool = False) -> tuple[tuple[int, float], ...]:
    """Only the draft step of `config`'s drafter (`HardwareProfile.draft_step_s`): what another drafter's profile
    differs in, so comparing drafters (runtime/warmup.py `choose_drafter`) measures the rest once."""
    with torch.inference_mode():
        return _draft_steps(config, 1 if quick else 3, quick)


def _draft_steps(config: EngineConfig, reps: int, quick: bool) -> tuple[tuple[int, float], ...]:
    """One draft token step versus rows, on the model the drafter's class names (`step_model`: the draft model,
    or the target with only its resident experts); a drafter with no model to time: a nominal 1 ms."""
    stepped = config.drafter_class.step_model(config)
    if stepped is None:
        return ((1, 1e-3),)
    draft, allowed = stepped
    out = []
    for rows in DRAFT_ROWS[:3] if quick else DRAFT_ROWS:
        cache = draft.new_cache(rows, 80, growable=False)
        cache.advance(torch.full((rows,), 64, dtype=torch.long))
        ids = torch.ones(rows, 1, dtype=torch.long)
        last = torch.zeros(rows, 1, dtype=torch.long)

        def step(cache=cache, ids=ids, last=last) -> None:
            draft.forward(ids, cache, num_new=torch.zeros(ids.shape[0], dtype=torch.long), output_positions=last,
                          allowed_experts=allowed)

        out.append((rows, _time(step, reps)))
    return tuple(out)
