"""Timed spans per resource, a Chrome / Perfetto trace export, and a per-resource time breakdown that adds up.

The offload executor runs operations concurrently on a few resources ("io": weight loads over disk / link,
"cpu": CPU attention, "device": FFN and draft compute). Every operation is a `Span` on one resource's track.

Breakdown definitions, for a window [lo, hi] (default: first span start .. last span end), spans clipped to it:
  wall                 = hi - lo
  busy(r)              = measure of the union of r's spans (spans of r that overlap each other count once)
  idle(r)              = wall - busy(r)
  by_name(r)[n]        = the part of busy(r) attributed to spans named n. Where spans of r overlap, each instant
                         goes to the span that started first (ties: the one recorded first), so the names
                         partition busy(r): sum(by_name(r).values()) == busy(r).
  overlap              = partition of the wall time by the set of resources busy at each instant (the empty set
                         is the time when all are idle): the durations sum to wall, and busy(r) is the sum of the
                         entries whose set contains r. Overlapped time appears once, under its set.
  serial_time          = sum over r of busy(r) (the wall time if nothing overlapped)
  overlap_saving       = serial_time - wall
  overlap_efficiency   = max busy(r) / wall, in (0, 1]: 1.0 means the busiest resource never waited
                         (this is 1 / (wall / max busy), the reciprocal of the slowdown over perfect overlap).

All of these come from one sweep over the sorted span endpoints, and sums use `math.fsum`, so the identities hold
to float rounding (far below 1e-9 s for traces of practical length).
"""

from __future__ import annotations

import heapq
import json
import math
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from types import TracebackType
from typing import Any

PROCESS_NAME = "specoffload"
PRIMARY_RESOURCES = ("io", "cpu", "device")  # shown first, in this order; other tracks follow alphabetically

Window = tuple[float, float]


def resource_order(resources: Iterable[str]) -> list[str]:
    """Distinct resources in display order: io, cpu, device first, then the others alphabetically."""
    distinct = set(resources)
    primary = [r for r in PRIMARY_RESOURCES if r in distinct]
    return primary + sorted(distinct.difference(PRIMARY_RESOURCES))


@dataclass(frozen=True)
class Span:
    """One timed operation on one resource's track. Times are `time.perf_counter()` seconds.

    `args` (JSON-able: step, layer, batch, bytes, ...) is metadata: it takes no part in equality or hashing.
    """

    name: str
    resource: str
    start: float
    end: float
    args: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(
                f"span {self.name!r} on {self.resource!r} ends before it starts: {self.start} > {self.end}"
            )
        object.__setattr__(self, "args", dict(self.args))  # a private copy: the caller's dict may change

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class ResourceUsage:
    """One resource's time in a window: busy + idle == wall; the by_name values sum to busy."""

    resource: str
    busy: float
    idle: float
    by_name: Mapping[str, float]

    def top_names(self, n: int = 3) -> list[tuple[str, float]]:
        """The n span names with the most busy time, largest first (ties by name)."""
        return sorted(self.by_name.items(), key=lambda item: (-item[1], item[0]))[:n]


@dataclass(frozen=True)
class Breakdown:
    """Per-resource busy / idle time and the partition of the wall time by which resources were busy."""

    wall: float
    resources: tuple[ResourceUsage, ...]
    overlap: tuple[tuple[frozenset[str], float], ...]

    @property
    def serial_time(self) -> float:
        """Sum of the resources' busy times: the wall time a fully serial execution would take."""
        return math.fsum(usage.busy for usage in self.resources)

    @property
    def overlap_saving(self) -> float:
        """Seconds saved by overlap: serial_time - wall (negative when resources sat idle together)."""
        return self.serial_time - self.wall

    @property
    def overlap_efficiency(self) -> float:
        """max busy / wall in (0, 1]; 1.0 = the busiest resource never waited. 0.0 for an empty trace."""
        busiest = max((usage.busy for usage in self.resources), default=0.0)
        return busiest / self.wall if self.wall > 0 else 0.0

    def usage(self, resource: str) -> ResourceUsage:
        """The row for one resource (KeyError if it is not in this breakdown)."""
        for usage in self.resources:
            if usage.resource == resource:
                return usage
        raise KeyError(resource)

    def table(self) -> str:
        """Markdown: a row per resource, the overlap partition, and a line checking that both add up to wall."""
        wall = self.wall
        lines = [
            "| resource | busy s | idle s | busy % | top span names |",
            "|---|---:|---:|---:|---|",
        ]
        for usage in self.resources:
            top = ", ".join(f"{name} {seconds:.4f}s" for name, seconds in usage.top_names())
            lines.append(
                f"| {usage.resource} | {usage.busy:.4f} | {usage.idle:.4f} | {_percent(usage.busy, wall)} | {top} |"
            )
        order = {r: i for i, r in enumerate(u.resource for u in self.resources)}
        lines += ["", "| busy set | seconds | % of wall |", "|---|---:|---:|"]
        for busy_set, seconds in self.overlap:
            label = " + ".join(sorted(busy_set, key=order.__getitem__)) if busy_set else "(all idle)"
            lines.append(f"| {label} | {seconds:.4f} | {_percent(seconds, wall)} |")
        resource_error = max((abs(u.busy + u.idle - wall) for u in self.resources), default=0.0)
        partition_sum = math.fsum(seconds for _, seconds in self.overlap)
        lines += [
            "",
            f"wall {wall:.4f} s; serial time {self.serial_time:.4f} s; overlap saving {self.overlap_saving:.4f} s; "
            f"overlap efficiency {self.overlap_efficiency:.3f}",
            f"check: max |busy + idle - wall| = {resource_error:.1e} s; "
            f"partition sums to {partition_sum:.6f} s vs wall {wall:.6f} s (error {abs(partition_sum - wall):.1e} s)",
        ]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, with the derived totals."""
        order = {r: i for i, r in enumerate(u.resource for u in self.resources)}
        return {
            "wall": self.wall,
            "serial_time": self.serial_time,
            "overlap_saving": self.overlap_saving,
            "overlap_efficiency": self.overlap_efficiency,
            "resources": [
                {"resource": u.resource, "busy": u.busy, "idle": u.idle, "by_name": dict(u.by_name)}
                for u in self.resources
            ],
            "overlap": [
                {"resources": sorted(busy_set, key=order.__getitem__), "seconds": seconds}
                for busy_set, seconds in self.overlap
            ],
        }


def _percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}" if whole > 0 else "-"


def default_window(spans: Sequence[Span]) -> Window:
    """[first start, last end] over the spans; (0, 0) when there are none."""
    if not spans:
        return (0.0, 0.0)
    return (min(s.start for s in spans), max(s.end for s in spans))


def breakdown(spans: Sequence[Span], window: Window | None = None, resources: Sequence[str] | None = None) -> Breakdown:
    """Busy / idle per resource and the overlap partition over `window`; see the module docstring.

    resources: the tracks to report, in this order (a track with no spans gets busy 0); spans on other tracks
    are left out of the partition too. Default: every track with a span, in `resource_order`.
    The default window covers all spans, whichever resources are reported.
    """
    lo, hi = default_window(spans) if window is None else window
    if hi < lo:
        raise ValueError(f"window ends before it starts: {(lo, hi)}")
    ordered = sorted(spans, key=lambda s: s.start)  # stable: ties keep recording order
    names = resource_order(s.resource for s in ordered) if resources is None else list(resources)
    wanted = set(names)
    # rank = index in `ordered`: a lower rank started earlier, so it wins the attribution of shared instants
    clipped = [
        (rank, max(s.start, lo), min(s.end, hi))
        for rank, s in enumerate(ordered)
        if s.resource in wanted and min(s.end, hi) > max(s.start, lo)
    ]
    starts_at: dict[float, list[int]] = defaultdict(list)
    ends_at: dict[float, list[int]] = defaultdict(list)
    for rank, start, end in clipped:
        starts_at[start].append(rank)
        ends_at[end].append(rank)
    times = sorted({lo, hi}.union(starts_at, ends_at))

    active: set[int] = set()
    heaps: dict[str, list[int]] = {r: [] for r in names}  # per resource: ranks of started spans (lazy deletion)
    by_name_parts: dict[str, dict[str, list[float]]] = {r: defaultdict(list) for r in names}
    partition_parts: dict[frozenset[str], list[float]] = defaultdict(list)
    for t, t_next in pairwise(times):
        active.difference_update(ends_at.get(t, ()))
        for rank in starts_at.get(t, ()):
            active.add(rank)
            heapq.heappush(heaps[ordered[rank].resource], rank)
        dt = t_next - t
        busy_now = []
        for resource, heap in heaps.items():
            while heap and heap[0] not in active:
                heapq.heappop(heap)
            if heap:
                busy_now.append(resource)
                by_name_parts[resource][ordered[heap[0]].name].append(dt)
        partition_parts[frozenset(busy_now)].append(dt)

    wall = hi - lo
    usages = []
    for resource in names:
        parts = by_name_parts[resource]
        busy = math.fsum(dt for segment in parts.values() for dt in segment)
        by_name = {name: math.fsum(segment) for name, segment in sorted(parts.items())}
        usages.append(ResourceUsage(resource, busy, wall - busy, by_name))
    order = {r: i for i, r in enumerate(names)}
    overlap = sorted(
        ((busy_set, math.fsum(parts)) for busy_set, parts in partition_parts.items()),
        key=lambda item: (len(item[0]), sorted(order[r] for r in item[0])),
    )
    return Breakdown(wall=wall, resources=tuple(usages), overlap=tuple(overlap))


def chrome_trace(spans: Sequence[Span], window: Window | None = None) -> dict[str, Any]:
    """Chrome trace-event JSON (opens in Perfetto / chrome://tracing): one thread track per resource.

    Spans meeting the window are clipped to it; ts / dur are microseconds from the window start.
    """
    lo, hi = default_window(spans) if window is None else window
    shown = sorted((s for s in spans if s.start <= hi and s.end >= lo), key=lambda s: s.start)
    tids = {resource: i + 1 for i, resource in enumerate(resource_order(s.resource for s in shown))}
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": PROCESS_NAME}},
    ]
    for resource, tid in tids.items():
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": resource}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
    for s in shown:
        start, end = max(s.start, lo), min(s.end, hi)
        events.append(
            {
                "name": s.name,
                "cat": s.resource,
                "ph": "X",
                "ts": (start - lo) * 1e6,
                "dur": (end - start) * 1e6,
                "pid": 1,
                "tid": tids[s.resource],
                "args": dict(s.args),
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


class _SpanTimer(AbstractContextManager["_SpanTimer"]):
    """Times its `with` body and records it on exit, also when the body raises."""

    __slots__ = ("_tracer", "_name", "_resource", "_args", "_start")

    def __init__(self, tracer: Tracer, name: str, resource: str, args: dict[str, Any]) -> None:
        self._tracer, self._name, self._resource, self._args = tracer, name, resource, args
        self._start = 0.0

    def __enter__(self) -> _SpanTimer:
        self._start = time.perf_counter()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._tracer.add(self._name, self._resource, self._start, time.perf_counter(), **self._args)


_NO_SPAN = nullcontext()


class Tracer:
    """Thread-safe span recorder. A disabled tracer records nothing, and its span() is a shared no-op context."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._spans: list[Span] = []

    def span(self, name: str, resource: str, **args: Any) -> AbstractContextManager[Any]:
        """`with tracer.span("ffn", "device", layer=3): ...` records the body's start / end (perf_counter)."""
        if not self.enabled:
            return _NO_SPAN
        return _SpanTimer(self, name, resource, args)

    def add(self, name: str, resource: str, start: float, end: float, **args: Any) -> None:
        """Record a span timed elsewhere (perf_counter seconds)."""
        if not self.enabled:
            return
        span = Span(name, resource, start, end, args)
        with self._lock:
            self._spans.append(span)

    @property
    def spans(self) -> list[Span]:
        """A copy of the recorded spans, sorted by start (ties in recording order)."""
        with self._lock:
            recorded = list(self._spans)
        return sorted(recorded, key=lambda s: s.start)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def mark(self) -> float:
        """The current perf_counter time: take two marks to delimit a window, e.g. one decode step."""
        return time.perf_counter()

    def chrome_trace(self, window: Window | None = None) -> dict[str, Any]:
        return chrome_trace(self.spans, window)

    def save_chrome_trace(self, path: str | Path, window: Window | None = None) -> Path:
        """Write the Chrome trace JSON (creating parent directories); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            json.dump(self.chrome_trace(window), f)
        return path

    def breakdown(self, window: Window | None = None, resources: Sequence[str] | None = None) -> Breakdown:
        return breakdown(self.spans, window, resources)
