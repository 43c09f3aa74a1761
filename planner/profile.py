"""`HardwareProfile`: the measured costs of one machine + model pair, the planner's only view of the hardware.

The runtime's profiler measures it once and saves it as JSON with its provenance; the planner reuses it until
the hardware (or the models, dtype, torch version) changes: `matches(fingerprint)` says whether it still applies.

Three resources (schedule.py): "io" delivers streamed weights into ring slots at `stream_bytes_per_s`; "cpu"
runs the target's attention against the host KV cache (`attention_fit`); "device" runs the target's FFN / head
GEMMs (`ffn_flops_per_s` for streamed weights, `resident_ffn_flops_per_s` for resident ones, which the runtime
keeps in oneDNN's packed layout on a CPU; `head_flops_per_s`) and the draft (`draft_step_s`). On a CPU-only
machine "cpu" and "device" are the same cores: `shared_compute` (their busy times add, cost.py).

Interpolation (all clamp below the first point):
    ffn rate(rows)    piecewise linear in log(rows) between measured points, constant outside them;
    draft_seconds(r)  piecewise linear in rows, extended above the last point along the last segment's slope
                      (with one point: proportional to rows above it), so a prefill of many rows extrapolates.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .errors import SpecOffloadError

FORMAT = "specoffload.hardware_profile"
VERSION = 1
DEVICES = ("cpu", "cuda")
WEIGHTS_TIERS = ("disk", "ram")


class ProfileError(SpecOffloadError, ValueError):
    """A hardware profile is invalid, unreadable, or does not apply to the plan it is used for."""


@dataclass(frozen=True)
class HardwareProfile:
    """Measured costs of one machine + model pair; JSON with provenance, reused until the hardware changes."""

    provenance: Mapping[str, Any] = field(hash=False)  # machine, cpu model, cores, torch, device, date, models, dtype
    device: str  # "cpu" | "cuda"
    shared_compute: bool  # cpu attention and device compute share cores (CPU-only machine)
    weights_tier: str  # "disk" | "ram": where the measured stream reads from
    stream_bytes_per_s: float  # bytes of compute-dtype weights delivered into ring slots per second
    ffn_flops_per_s: tuple[tuple[int, float], ...]  # (rows, FLOP/s) of the device GEMM at the target FFN shape
    attention_fit: tuple[float, float, float]  # s/layer = c0 + c1 * new_tokens + c2 * new_tokens * attended_len
    draft_step_s: tuple[tuple[int, float], ...]  # (rows, seconds) of one draft token step (whole draft model)
    head_flops_per_s: float | None = None  # None: the ffn rate at the head's rows
    # (rows, FLOP/s) of the same GEMM on weights kept resident (packed layout on CPU); None: as ffn_flops_per_s
    resident_ffn_flops_per_s: tuple[tuple[int, float], ...] | None = None
    pass_overhead_s: float = 0.0  # fixed per target pass (embed, verify, bookkeeping): calibrated on real passes
    # per position a pass verifies (rows x (k + 1) decoding, rows in a prefill): the head's output, sampling and
    # verification, bookkeeping per row; calibrated on real passes
    position_overhead_s: float = 0.0
    # the measured passes the two overheads (and the in-pass stream rate) were fitted on, for the record
    calibration: tuple[Mapping[str, float], ...] = field(default=(), hash=False, compare=False)
    # Compressed weights (a `specoffload quantize` checkpoint): the loader reads a compressed part's stored bytes
    # at `read_bytes_per_s` (None: from host RAM, no read) and writes its compute-dtype bytes by dequantizing at
    # `decompress_bytes_per_s`, one after the other on its thread (load_seconds). None: not measured (the part
    # is priced at stream_bytes_per_s like any other).
    read_bytes_per_s: float | None = None
    decompress_bytes_per_s: float | None = None
    # Host attention beside a GPU: each layer's hidden states cross the link twice (to the host for attention, back
    # for the FFN): seconds per copy = a + b * bytes (pinned, measured). None: no such copies (a CPU-only machine).
    hidden_link_fit: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        try:
            provenance = json.loads(json.dumps(dict(self.provenance)))  # JSON-normalised: tuples become lists
        except (TypeError, ValueError) as exc:
            raise ProfileError(f"provenance must be a JSON-serialisable mapping: {exc}") from exc
        object.__setattr__(self, "provenance", MappingProxyType(provenance))
        if self.device not in DEVICES:
            raise ProfileError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.weights_tier not in WEIGHTS_TIERS:
            raise ProfileError(f"weights_tier must be one of {WEIGHTS_TIERS}, got {self.weights_tier!r}")
        if not isinstance(self.shared_compute, bool):
            raise ProfileError(f"shared_compute must be a bool, got {self.shared_compute!r}")
        _positive("stream_bytes_per_s", self.stream_bytes_per_s)
        object.__setattr__(self, "ffn_flops_per_s", check_points("ffn_flops_per_s", self.ffn_flops_per_s))
        object.__setattr__(self, "draft_step_s", check_points("draft_step_s", self.draft_step_s))
        if self.resident_ffn_flops_per_s is not None:
            object.__setattr__(self, "resident_ffn_flops_per_s",
                               check_points("resident_ffn_flops_per_s", self.resident_ffn_flops_per_s))
        fit = tuple(float(c) for c in self.attention_fit)
        if len(fit) != 3 or not all(math.isfinite(c) and c >= 0 for c in fit):
            raise ProfileError(f"attention_fit must be 3 finite coefficients >= 0 (c0, c1, c2), got {fit}")
        object.__setattr__(self, "attention_fit", fit)
        if self.head_flops_per_s is not None:
            _positive("head_flops_per_s", self.head_flops_per_s)
        for name in ("read_bytes_per_s", "decompress_bytes_per_s"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.hidden_link_fit is not None:
            link = tuple(float(c) for c in self.hidden_link_fit)
            if len(link) != 2 or not all(math.isfinite(c) and c >= 0 for c in link):
                raise ProfileError(f"hidden_link_fit must be 2 finite coefficients >= 0 (a, b), got {link}")
            object.__setattr__(self, "hidden_link_fit", link)
        for name in ("pass_overhead_s", "position_overhead_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ProfileError(f"{name} must be a finite number >= 0, got {value!r}")
        object.__setattr__(self, "calibration", tuple(MappingProxyType(dict(c)) for c in self.calibration))

    # --- costs ---------------------------------------------------------------------------------------------------

    def ffn_rate(self, rows: float, resident: bool = False) -> float:
        """Device GEMM FLOP/s at `rows` rows: linear in log(rows) between points, clamped outside them.

        resident: the rate on weights kept resident (`resident_ffn_flops_per_s` when measured)."""
        _check_rows(rows)
        points = self.resident_ffn_flops_per_s if resident and self.resident_ffn_flops_per_s else self.ffn_flops_per_s
        xs = [math.log(r) for r, _ in points]
        ys = [y for _, y in points]
        return _interpolate(xs, ys, math.log(rows), extrapolate=False)

    def ffn_seconds(self, flops: float, rows: float, resident: bool = False) -> float:
        """Seconds for `flops` FLOPs of FFN GEMMs with `rows` rows per weight matrix: flops / rate(rows)."""
        if flops < 0:
            raise ValueError(f"flops must be >= 0, got {flops}")
        return flops / self.ffn_rate(rows, resident) if flops else 0.0

    def head_seconds(self, flops: float, rows: float) -> float:
        """Seconds of the LM head: flops / head_flops_per_s, or the ffn rate at `rows` when not measured."""
        if self.head_flops_per_s is None:
            return self.ffn_seconds(flops, rows)
        return flops / self.head_flops_per_s

    def attention_seconds(self, new_tokens: int, attended_len: int) -> float:
        """Seconds of one layer's attention op: c0 + c1 * new_tokens + c2 * new_tokens * attended_len.

        new_tokens = rows * tokens fed per row; attended_len = keys attended per token (the KV length).
        """
        if new_tokens < 0 or attended_len < 0:
            raise ValueError(f"new_tokens and attended_len must be >= 0, got {new_tokens}, {attended_len}")
        c0, c1, c2 = self.attention_fit
        return c0 + c1 * new_tokens + c2 * new_tokens * attended_len

    def hidden_link_seconds(self, nbytes: float) -> float:
        """Seconds of one host <-> device copy of `nbytes` bytes of hidden states: a + b * nbytes (0 unmeasured)."""
        if self.hidden_link_fit is None or nbytes <= 0:
            return 0.0
        a, b = self.hidden_link_fit
        return a + b * nbytes

    def load_seconds(self, nbytes: float, stored: float | None = None) -> float:
        """Seconds the loader takes to deliver a part of `nbytes` compute-dtype bytes into a slot: nbytes /
        stream_bytes_per_s, or for a compressed part stored as `stored` bytes (with a measured decompression rate)
        stored / read_bytes_per_s (0 from RAM) + nbytes / decompress_bytes_per_s."""
        if stored is None or self.decompress_bytes_per_s is None:
            return nbytes / self.stream_bytes_per_s
        read = stored / self.read_bytes_per_s if self.read_bytes_per_s is not None else 0.0
        return read + nbytes / self.decompress_bytes_per_s

    def scaled_io(self, factor: float) -> HardwareProfile:
        """This profile with every loader rate (stream, read, decompress) times `factor`: what a measured in-pass
        loader rate over the modelled one says (runtime/offload/calibrate.py, replan.py)."""
        _positive("io scale factor", factor)
        return replace(self, stream_bytes_per_s=self.stream_bytes_per_s * factor,
                       read_bytes_per_s=None if self.read_bytes_per_s is None else self.read_bytes_per_s * factor,
                       decompress_bytes_per_s=(None if self.decompress_bytes_per_s is None
                                               else self.decompress_bytes_per_s * factor))

    def scaled_compute(self, factor: float) -> HardwareProfile:
        """This profile with every compute cost times `factor` (every rate divided by it, every time and overhead
        multiplied): what a job's measured passes over the predicted ones say when the profile is off
        (runtime/offload/replan.py `Replanner.check_profile`)."""
        _positive("compute scale factor", factor)

        def rates(points: tuple[tuple[int, float], ...] | None) -> tuple[tuple[int, float], ...] | None:
            return None if points is None else tuple((r, v / factor) for r, v in points)

        return replace(self, ffn_flops_per_s=rates(self.ffn_flops_per_s),
                       resident_ffn_flops_per_s=rates(self.resident_ffn_flops_per_s),
                       head_flops_per_s=None if self.head_flops_per_s is None else self.head_flops_per_s / factor,
                       attention_fit=tuple(c * factor for c in self.attention_fit),
                       draft_step_s=tuple((r, s * factor) for r, s in self.draft_step_s),
                       pass_overhead_s=self.pass_overhead_s * factor,
                       position_overhead_s=self.position_overhead_s * factor)

    def overhead_seconds(self, positions: int) -> float:
        """Per target pass outside the modelled ops: pass_overhead_s + position_overhead_s * positions verified."""
        return self.pass_overhead_s + self.position_overhead_s * positions

    def draft_seconds(self, rows: float) -> float:
        """Seconds of one draft token step at `rows` rows: linear between points, clamped below, extrapolated above."""
        _check_rows(rows)
        points = self.draft_step_s
        if len(points) == 1:
            (r0, s0), = points
            return s0 * max(1.0, rows / r0)
        return _interpolate([float(r) for r, _ in points], [s for _, s in points], float(rows), extrapolate=True)

    # --- JSON ----------------------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "provenance": dict(self.provenance),
            "device": self.device,
            "shared_compute": self.shared_compute,
            "weights_tier": self.weights_tier,
            "stream_bytes_per_s": self.stream_bytes_per_s,
            "ffn_flops_per_s": [list(p) for p in self.ffn_flops_per_s],
            "attention_fit": list(self.attention_fit),
            "draft_step_s": [list(p) for p in self.draft_step_s],
            "head_flops_per_s": self.head_flops_per_s,
            "resident_ffn_flops_per_s": (None if self.resident_ffn_flops_per_s is None
                                         else [list(p) for p in self.resident_ffn_flops_per_s]),
            "pass_overhead_s": self.pass_overhead_s,
            "position_overhead_s": self.position_overhead_s,
            "calibration": [dict(c) for c in self.calibration],
            "read_bytes_per_s": self.read_bytes_per_s,
            "decompress_bytes_per_s": self.decompress_bytes_per_s,
            "hidden_link_fit": None if self.hidden_link_fit is None else list(self.hidden_link_fit),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> HardwareProfile:
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ProfileError(
                f"not a hardware profile of format {FORMAT!r} version {VERSION} "
                f"(got format {data.get('format')!r}, version {data.get('version')!r}): measure it again"
            )
        names = ("provenance", "device", "shared_compute", "weights_tier", "stream_bytes_per_s", "ffn_flops_per_s",
                 "attention_fit", "draft_step_s")
        missing = [name for name in names if name not in data]
        if missing:
            raise ProfileError(f"hardware profile lacks the fields {missing}")
        try:
            return cls(
                **{name: data[name] for name in names},
                head_flops_per_s=data.get("head_flops_per_s"),
                resident_ffn_flops_per_s=data.get("resident_ffn_flops_per_s"),
                pass_overhead_s=float(data.get("pass_overhead_s", 0.0)),
                position_overhead_s=float(data.get("position_overhead_s", 0.0)),
                calibration=tuple(data.get("calibration", ())),
                read_bytes_per_s=data.get("read_bytes_per_s"),
                decompress_bytes_per_s=data.get("decompress_bytes_per_s"),
                hidden_link_fit=data.get("hidden_link_fit"),
            )
        except (TypeError, ValueError) as exc:  # ProfileError is a ValueError: re-raised with the same message
            raise ProfileError(f"invalid hardware profile: {exc}") from exc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ProfileError(f"cannot read hardware profile {str(path)!r}: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise ProfileError(f"hardware profile {str(path)!r} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ProfileError(f"hardware profile {str(path)!r} must hold a JSON object")
        return cls.from_json(data)

    def matches(self, fingerprint: Mapping[str, Any]) -> bool:
        """True if every key of `fingerprint` (machine, cpu model, torch version, models, ...) equals the provenance.

        Values compare after JSON normalisation, so a tuple in the fingerprint equals the list a loaded file holds.
        """
        normalised = json.loads(json.dumps(dict(fingerprint)))
        return all(key in self.provenance and self.provenance[key] == value for key, value in normalised.items())


def _interpolate(xs: list[float], ys: list[float], x: float, *, extrapolate: bool) -> float:
    """Piecewise-linear y(x) through sorted points: clamped below; above, clamped or along the last segment."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        if not extrapolate or len(xs) == 1:
            return ys[-1]
        slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        return ys[-1] + slope * (x - xs[-1])
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def check_points(name: str, points: Any) -> tuple[tuple[int, float], ...]:
    """Validated (rows, value) points: rows integers >= 1 strictly increasing, values finite and > 0."""
    try:
        pts = tuple((r, float(v)) for r, v in points)
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"{name} must be a sequence of (rows, value) pairs: {exc}") from exc
    if not pts:
        raise ProfileError(f"{name} needs at least one (rows, value) point")
    rows = [r for r, _ in pts]
    if any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in rows):
        raise ProfileError(f"{name}: rows must be integers >= 1, got {rows}")
    if any(b <= a for a, b in zip(rows, rows[1:])):
        raise ProfileError(f"{name}: rows must be strictly increasing, got {rows}")
    if not all(math.isfinite(v) and v > 0 for _, v in pts):
        raise ProfileError(f"{name}: values must be finite and > 0, got {[v for _, v in pts]}")
    return pts


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ProfileError(f"{name} must be a finite number > 0, got {value!r}")


def _check_rows(rows: float) -> None:
    if not rows >= 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
