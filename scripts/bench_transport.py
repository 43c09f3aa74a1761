#!/usr/bin/env python
"""Benchmark: tensor handoff between processes, shm arena + ZeroMQ header vs Ray's object store vs memcpy.

A producer (this process, the "driver") hands a float32 tensor to a consumer in another process:

  memcpy                 copy into a preallocated buffer in this process: the bandwidth roof
  shm: copy in, view     write_tensor into the arena + header round trip; the consumer maps a zero-copy view
  shm: copy in, copy out the same, and the consumer copies the view into its own preallocated buffer
  shm: zero-copy         the producer computed straight into the arena: only the header round trip
  ray: put tensor        ray.put(tensor) + an actor call taking the ref (Ray's default torch serialization)
  ray: put numpy         ray.put(tensor.numpy()): the actor gets a read-only zero-copy numpy view

at each size, plus the round-trip latency of a header-only request (OpRequest with two TensorRefs) over ZeroMQ
ipc and of an empty Ray actor call. Every process runs one torch thread; systems alternate inside each
repetition; medians and min-max across repetitions. Writes docs/perf/transport.json and the transport section
of docs/perf/README.md.

    python -m scripts.bench_transport             # about a minute on 2 cores, Ray start included
    python -m scripts.bench_transport --no-ray    # shm and memcpy only
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import zmq

from scripts.common import PERF, median_spread, utc_now, write_json
from scripts.readme_section import write_section
from specoffload.actors.transport.arena import Arena, Region
from specoffload.actors.transport.channel import ChannelConfig, Client, Server
from specoffload.actors.transport.codec import (
    OpRequest,
    OpResult,
    decode,
    encode,
    read_tensor,
    tensor_view,
    write_tensor,
)
from specoffload.planner.units import parse_bytes

SHM_SYSTEMS = ("shm: copy in, view", "shm: copy in, copy out", "shm: zero-copy")
RAY_SYSTEMS = ("ray: put tensor", "ray: put numpy")
SPIN_US = 150
LATENCY_ZMQ = "zmq ipc: OpRequest (2 TensorRefs) -> OpResult"
LATENCY_SPIN = f"zmq ipc, the same with a client spinning up to {SPIN_US} µs (spin_us)"
LATENCY_RAW = "zmq ipc raw: the same frames echoed, no codec"
LATENCY_CODEC = "codec only: encode + decode of both, in-process"
GOAL_BANDWIDTH, GOAL_LATENCY_US = 0.70, 200.0  # 64 MiB copy-in handoff vs memcpy; header round trip p50
BYTES_PER_REP = 256 << 20  # iterations per measurement: about this many bytes, 3..300 handoffs


def consumer_main(cfg: ChannelConfig, arena_path: str, stop: Any) -> None:
    """The consumer process: answers "view", "copy", "checksum" and "ping" requests."""
    torch.set_num_threads(1)
    arena = Arena.attach(arena_path)
    arenas = {arena.name: arena}
    buffers: dict[int, torch.Tensor] = {}

    def handle(req: OpRequest) -> OpResult:
        if req.kind == "ping":
            return OpResult(req.op_id)
        x = read_tensor(arenas, req.tensors["x"])
        if req.kind == "copy":
            if x.nbytes not in buffers:
                buffers[x.nbytes] = torch.empty_like(x)
            buffers[x.nbytes].copy_(x)
        elif req.kind == "checksum":
            return OpResult(req.op_id, meta={"sum": float(x.double().sum())})
        return OpResult(req.op_id)

    with Server(cfg) as server:
        server.serve_forever(handle, stop, poll_s=0.1)
    arena.close()


def raw_echo_main(address: str, stop: Any) -> None:
    """A bare pyzmq ROUTER echoing frames: the floor under the channel's round trip (no codec, no wrapper)."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    while not stop.is_set():
        if sock.poll(100):
            sock.send_multipart(sock.recv_multipart())
    sock.close()


class RayConsumer:
    """The Ray actor (made remote in `start_ray`): receives the object its argument refers to."""

    def __init__(self) -> None:
        torch.set_num_threads(1)

    def take(self, x: Any) -> int:
        return int(x.nbytes)

    def checksum(self, x: Any) -> float:
        return float(torch.as_tensor(x).double().sum())

    def ping(self) -> int:
        return 0


def timed(fn: Callable[[], object], iters: int) -> float:
    """Seconds per call of `fn`, averaged over `iters` calls after two warm-up calls."""
    fn()
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def percentiles(fn: Callable[[], object], n: int) -> tuple[float, float]:
    """p50 and p99 in microseconds of `n` calls of `fn` (after 50 warm-up calls)."""
    for _ in range(50):
        fn()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2] * 1e6, samples[min(n - 1, round(n * 0.99))] * 1e6


def start_ray() -> tuple[Any, Any, str]:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=1 << 30, log_to_driver=False)
    auth = os.environ.get("RAY_AUTH_MODE", "unset")  # ray.init sets "token" when it enabled auth by default
    return ray, ray.remote(num_cpus=1)(RayConsumer).remote(), auth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64KiB,4MiB,64MiB", help="comma-separated tensor sizes")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--latency-calls", type=int, default=2000, help="header round trips per repetition")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray rows")
    parser.add_argument("--out", type=Path, default=PERF)
    args = parser.parse_args()
    sizes = [parse_bytes(s.strip()) for s in args.sizes.split(",")]
    load_before = os.getloadavg()[0]  # a busy machine shows here: other jobs distort every row
    torch.set_num_threads(1)

    arena = Arena.create("bench", sum(sizes) * 2 + (1 << 20))
    sources = {n: torch.rand(n // 4) for n in sizes}  # [n / 4] float32 in the producer's private memory
    copies = {n: torch.empty(n // 4) for n in sizes}
    regions = {n: arena.alloc(n) for n in sizes}
    cfg = ChannelConfig("bench_transport")
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    consumer = ctx.Process(target=consumer_main, args=(cfg, str(arena.path), stop), daemon=True)
    consumer.start()
    raw_cfg = ChannelConfig("bench_transport_raw")
    raw_echo = ctx.Process(target=raw_echo_main, args=(raw_cfg.address, stop), daemon=True)
    raw_echo.start()
    client = Client(cfg)
    spinning = Client(dataclasses.replace(cfg, spin_us=SPIN_US))  # the same server
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(raw_cfg.address)
    ray = actor = None
    ray_auth = "not run"
    try:
        client.call(OpRequest(0, "ping"), timeout_s=120)  # waits for the consumer's start
        raw.send_multipart([b"warm-up!", b""])
        assert raw.poll(120_000), "the raw echo process did not start"
        raw.recv_multipart()
        if not args.no_ray:
            ray, actor, ray_auth = start_ray()
            ray.get(actor.ping.remote())
        verify(client, ray, actor, arena, regions, sources)
        spinning.call(OpRequest(0, "ping"), timeout_s=60)
        result = run(args, sizes, client, spinning, raw, ray, actor, arena, regions, sources, copies)
    finally:
        client.close()
        spinning.close()
        raw.close()
        stop.set()
        consumer.join(timeout=30)
        raw_echo.join(timeout=30)
        raw_cfg.socket_path.unlink(missing_ok=True)
        arena.close()
        if ray is not None:
            ray.shutdown()
    result["run"] = run_info(args, sizes, ray_auth, load_before)
    write_json(args.out / "transport.json", result)
    table = markdown(result)
    print(table)
    write_section(args.out / "README.md", "transport", table, heading="transport (`scripts/bench_transport.py`)")


def verify(client: Client, ray: Any, actor: Any, arena: Arena, regions: dict, sources: dict) -> None:
    """The consumer sees exactly the producer's bytes (checksums agree) before anything is timed."""
    for n, src in sources.items():
        ref = write_tensor(arena, regions[n], src)
        expected = float(src.double().sum())
        got = client.call(OpRequest(1, "checksum", tensors={"x": ref}), timeout_s=60).meta["sum"]
        assert got == expected, f"shm checksum mismatch at {n} bytes: {got} != {expected}"
        if ray is not None:
            assert ray.get(actor.checksum.remote(ray.put(src))) == expected, f"ray checksum mismatch at {n} bytes"


def run(args: argparse.Namespace, sizes: list[int], client: Client, spinning: Client, raw: zmq.Socket, ray: Any,
        actor: Any, arena: Arena, regions: dict, sources: dict, copies: dict) -> dict:  # fmt: skip
    times: dict[tuple[str, int], list[float]] = {}
    latency: dict[str, list[tuple[float, float]]] = {}
    some_ref = tensor_view(arena, regions[sizes[0]], torch.float32, (2, 8))[0]
    header = OpRequest(1, "ping", layer=3, batch=1, tensors={"x": some_ref, "out": some_ref})
    raw_frames = [b"12345678", encode(header)]  # what Client.call sends: request id, message
    for rep in range(args.reps):
        for n in sizes:
            src, region = sources[n], regions[n]
            ref = tensor_view(arena, region, torch.float32, tuple(src.shape))[0]  # data the producer computed there
            iters = max(3, min(300, BYTES_PER_REP // n))
            systems: dict[str, Callable[[], object]] = {
                "memcpy": lambda dst=copies[n], src=src: dst.copy_(src),
                SHM_SYSTEMS[0]: lambda r=region, src=src: handoff(client, arena, r, src, "view"),
                SHM_SYSTEMS[1]: lambda r=region, src=src: handoff(client, arena, r, src, "copy"),
                SHM_SYSTEMS[2]: lambda ref=ref: client.call(OpRequest(2, "view", tensors={"x": ref}), 60),
            }
            if ray is not None:
                systems[RAY_SYSTEMS[0]] = lambda src=src: ray.get(actor.take.remote(ray.put(src)))
                systems[RAY_SYSTEMS[1]] = lambda src=src: ray.get(actor.take.remote(ray.put(src.numpy())))
            for name, fn in systems.items():
                times.setdefault((name, n), []).append(timed(fn, iters))
        latency.setdefault(LATENCY_ZMQ, []).append(percentiles(lambda: client.call(header, 10), args.latency_calls))
        latency.setdefault(LATENCY_SPIN, []).append(percentiles(lambda: spinning.call(header, 10), args.latency_calls))
        latency.setdefault(LATENCY_RAW, []).append(
            percentiles(lambda f=raw_frames: (raw.send_multipart(f), raw.recv_multipart()), args.latency_calls)
        )
        latency.setdefault(LATENCY_CODEC, []).append(
            percentiles(lambda: decode(encode(OpResult(decode(encode(header)).op_id))), args.latency_calls)
        )
        if ray is not None:
            latency.setdefault("ray: actor call -> get", []).append(
                percentiles(lambda: ray.get(actor.ping.remote()), max(100, args.latency_calls // 10))
            )
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)
    return summarize(times, latency)


def handoff(client: Client, arena: Arena, region: Region, src: torch.Tensor, kind: str) -> object:
    """Copy `src` into the arena and send its header; the consumer maps it ("view") or copies it out ("copy")."""
    return client.call(OpRequest(2, kind, tensors={"x": write_tensor(arena, region, src)}), timeout_s=60)


def summarize(times: dict, latency: dict) -> dict:
    memcpy = {n: statistics.median(ts) for (name, n), ts in times.items() if name == "memcpy"}
    rows = []
    for (name, n), ts in times.items():
        gbps, gbps_min, gbps_max = median_spread(n / t / 1e9 for t in ts)
        rows.append(
            {
                "system": name,
                "bytes": n,
                "seconds": ts,
                "us_median": statistics.median(ts) * 1e6,
                "gb_per_s_median": gbps,
                "gb_per_s_min": gbps_min,
                "gb_per_s_max": gbps_max,
                "vs_memcpy": memcpy[n] / statistics.median(ts),
            }
        )
    lat_rows = []
    for name, reps in latency.items():
        p50s, p99s = [p for p, _ in reps], [p for _, p in reps]
        lat_rows.append(
            {
                "system": name,
                "p50_us_per_rep": p50s,  # in repetition order
                "p99_us_per_rep": p99s,
                "p50_us_median": statistics.median(p50s),
                "p99_us_median": statistics.median(p99s),
            }
        )
    return {"rows": rows, "latency": lat_rows}


def run_info(args: argparse.Namespace, sizes: list[int], ray_auth: str, load_before: float) -> dict:
    try:
        import ray

        ray_version = ray.__version__
    except ImportError:
        ray_version = None
    return {
        "timestamp": utc_now(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads_per_process": 1,
        "torch": torch.__version__,
        "ray": ray_version,
        "ray_auth_mode": ray_auth,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "reps": args.reps,
        "sizes": sizes,
        "latency_calls": args.latency_calls,
        "load_avg_1min_before_after": [load_before, os.getloadavg()[0]],
    }


def fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def markdown(result: dict) -> str:
    info = result["run"]
    lines = [
        f"Run {info['timestamp']} on {info['machine']} ({info['cpus']} cores), one torch thread per process, "
        f"torch {info['torch']}, Ray {info['ray']} (RAY_AUTH_MODE: {info['ray_auth_mode']}), "
        f"libzmq {info['libzmq']}; {info['reps']} repetitions, systems alternating inside each; 1-min load "
        "average before / after: {:.2f} / {:.2f}.".format(*info["load_avg_1min_before_after"]),
        "",
        "| size | system | time per handoff (µs, median) | GB/s median | min–max | vs memcpy |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(result["rows"], key=lambda r: r["bytes"]):
        lines.append(
            f"| {fmt_size(r['bytes'])} | {r['system']} | {r['us_median']:.0f} | {r['gb_per_s_median']:.2f} | "
            f"{r['gb_per_s_min']:.2f}–{r['gb_per_s_max']:.2f} | {r['vs_memcpy']:.2f} |"
        )
    lines += ["", "| round trip, header only | p50 µs (median, min–max) | p99 µs (median, min–max) |", "|---|---|---|"]
    for r in result["latency"]:
        p50, p99 = sorted(r["p50_us_per_rep"]), sorted(r["p99_us_per_rep"])
        lines.append(
            f"| {r['system']} | {r['p50_us_median']:.0f} ({p50[0]:.0f}–{p50[-1]:.0f}) | "
            f"{r['p99_us_median']:.0f} ({p99[0]:.0f}–{p99[-1]:.0f}) |"
        )
    lines += ["", *conclusions(result)]
    return "\n".join(lines)


def conclusions(result: dict) -> list[str]:
    """The goals, checked against this run's numbers, and what the rows mean."""
    rows = {(r["system"], r["bytes"]): r for r in result["rows"]}
    largest = max(r["bytes"] for r in result["rows"])
    handoff = rows[(SHM_SYSTEMS[0], largest)]
    lat = next(r for r in result["latency"] if r["system"] == LATENCY_ZMQ)
    out = [
        f"- Goal: {fmt_size(largest)} handoff (copy in, view) at >= {GOAL_BANDWIDTH:.0%} of memcpy: "
        f"{handoff['vs_memcpy']:.2f} ({'met' if handoff['vs_memcpy'] >= GOAL_BANDWIDTH else 'NOT met'}); "
        "a producer that computes into the arena (zero-copy) pays only the header round trip.",
    ]
    lats = {r["system"]: r["p50_us_median"] for r in result["latency"]}
    spin = next(r for r in result["latency"] if r["system"] == LATENCY_SPIN)
    out.append(
        f"- Goal: header round trip p50 <= {GOAL_LATENCY_US:.0f} µs: {lat['p50_us_median']:.0f} µs with the "
        f"default config ({'met' if lat['p50_us_median'] <= GOAL_LATENCY_US else 'NOT met'}; p99 "
        f"{lat['p99_us_median']:.0f} µs), {spin['p50_us_median']:.0f} µs with spin_us={SPIN_US} "
        f"({'met' if spin['p50_us_median'] <= GOAL_LATENCY_US else 'NOT met'}; p99 {spin['p99_us_median']:.0f} µs)."
    )
    out.append(
        f"- For scale: a bare pyzmq ROUTER echoing the same frames takes {lats[LATENCY_RAW]:.0f} µs, and the codec "
        f"(encode + decode of request and reply, in one process) {lats[LATENCY_CODEC]:.0f} µs. ZeroMQ hops through "
        "an I/O thread per process, so a round trip is several thread wake-ups; spinning on the client saves one."
    )
    ray_row = rows.get((RAY_SYSTEMS[0], largest))
    if ray_row is not None:
        out.append(
            f"- Ray's object store with its default torch serialization moves {fmt_size(largest)} at "
            f"{ray_row['gb_per_s_median']:.2f} GB/s; the shm handoff is "
            f"{ray_row['us_median'] / handoff['us_median']:.0f}x faster (copy in, view) and "
            f"{ray_row['us_median'] / rows[(SHM_SYSTEMS[1], largest)]['us_median']:.0f}x (copy in, copy out)."
        )
    numpy_row, smallest = rows.get((RAY_SYSTEMS[1], largest)), min(r["bytes"] for r in result["rows"])
    if numpy_row is not None:
        out.append(
            f"- Ray with numpy (a read-only zero-copy view for the actor) reaches {numpy_row['vs_memcpy']:.2f} of "
            f"memcpy at {fmt_size(largest)}, but a {fmt_size(smallest)} handoff costs "
            f"{rows[(RAY_SYSTEMS[1], smallest)]['us_median']:.0f} µs there vs "
            f"{rows[(SHM_SYSTEMS[0], smallest)]['us_median']:.0f} µs over shm, and the view cannot be written."
        )
    out.append(
        "- Up to a few MiB a handoff costs about one header round trip plus the copy; copy out adds a second copy, "
        "so it tops out near half of memcpy. vs memcpy > 1 for zero-copy: no bytes move at all."
    )
    return out


if __name__ == "__main__":
    main()
