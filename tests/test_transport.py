"""runtime/transport: shared-memory arenas across processes, sweeping dead owners, the msgpack codec, channels.

Cross-process tests use the "spawn" start method (as Ray does: no inherited state). One spawned worker serves
every test that only needs "another process"; the sweep test spawns its own child to SIGKILL it.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pickle
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specoffload.actors.transport.arena import (
    SHM_DIR,
    Arena,
    ArenaError,
    ArenaFullError,
    ArenaName,
    FirstFitAllocator,
    Region,
    pid_namespace,
    sweep_dead_arenas,
)
from specoffload.actors.transport.channel import (
    ChannelConfig,
    ChannelConfigError,
    ChannelTimeout,
    Client,
    Puller,
    Pusher,
    RemoteError,
    Server,
)
from specoffload.actors.transport.codec import (
    DTYPES,
    ErrorReply,
    OpRequest,
    OpResult,
    TensorRef,
    WireError,
    decode,
    encode,
    message,
    read_tensor,
    tensor_view,
    write_tensor,
)
from specoffload.planner.errors import SpecOffloadError

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture(scope="module")
def other_process() -> Iterator[ProcessPoolExecutor]:
    """One spawned worker process, reused by the cross-process tests (a spawn costs a torch import)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=SPAWN) as pool:
        yield pool


def _our_shm_files(*pids: int) -> set[str]:
    return {p.name for p in SHM_DIR.iterdir() if (n := ArenaName.parse(p.name)) is not None and n.pid in pids}


# ---------------------------------------------------------------- arena


def test_arena_name_is_derived_from_prefix_pid_and_tag() -> None:
    name = ArenaName("kv", 1234, "jobA", ns=4026531836, nonce="0123abcd")
    assert name.path == Path("/dev/shm/specoffload-jobA-4026531836-1234-kv-0123abcd")
    assert ArenaName.parse(name.filename) == name
    assert ArenaName.parse("specoffload-job-1-0-kv-0123abcd") is None  # pid 0 is never ours
    assert ArenaName.parse("sem.mp-123") is None
    assert ArenaName.parse(name.filename + "\n") is None
    fresh = [ArenaName("kv", 1234) for _ in range(2)]
    assert fresh[0].ns == fresh[1].ns == pid_namespace() and fresh[0].nonce != fresh[1].nonce  # unguessable
    with pytest.raises(ValueError):
        ArenaName("k-v", 1234)  # a dash would make the name ambiguous to parse


def test_allocator_first_fit_alignment_and_coalescing() -> None:
    alloc = FirstFitAllocator(1024)
    a = alloc.alloc(100)  # [0, 100)
    b = alloc.alloc(10, align=256)  # [256, 266): [100, 256) stays free
    c = alloc.alloc(100)  # first fit: the gap at 128
    assert (a, b, c) == (Region(0, 100), Region(256, 10), Region(128, 100))
    assert alloc.free_bytes == 1024 - 210
    with pytest.raises(ArenaFullError):
        alloc.alloc(1000)
    alloc.free(b)
    with pytest.raises(ValueError):
        alloc.free(b)  # double free
    alloc.free(a)
    alloc.free(c)
    assert alloc.free_bytes == 1024
    assert alloc.alloc(1024) == Region(0, 1024)  # everything merged back into one range
    empty = FirstFitAllocator(2)
    assert [empty.alloc(0, align=1), empty.alloc(0, align=1)] == [Region(0, 1), Region(1, 1)]  # distinct offsets
    assert isinstance(ArenaFullError("x"), SpecOffloadError)  # a user-facing error: the arena is sized too small


def _attach_and_write(path: str, offset: int) -> tuple[list[int], bool]:
    """Child: read the parent's bytes, write float32 [0, 1, 2, 3] at `offset`, close; report whether the file
    survived the non-owner's close."""
    arena = Arena.attach(path)
    seen = arena.view(0, torch.uint8, (4,)).tolist()
    arena.view(offset, torch.float32, (4,)).copy_(torch.arange(4, dtype=torch.float32))
    arena.close()
    return seen, os.path.exists(path)


def test_arena_is_shared_across_processes(other_process: ProcessPoolExecutor) -> None:
    arena = Arena.create("shared", 4096, owner_tag="test")
    assert arena.path.name.startswith(f"specoffload-test-{pid_namespace()}-{os.getpid()}-shared-")
    assert arena.path.stat().st_mode & 0o777 == 0o600
    arena.view(0, torch.uint8, (4,)).copy_(torch.tensor([7, 8, 9, 10], dtype=torch.uint8))
    region = arena.alloc(16)
    view = arena.view(region.offset, torch.float32, (4,))  # taken before the child writes: zero-copy

    seen, survived = other_process.submit(_attach_and_write, str(arena.path), region.offset).result(timeout=120)

    assert seen == [7, 8, 9, 10]
    assert survived  # a non-owner's close() does not unlink
    assert torch.equal(view, torch.arange(4, dtype=torch.float32))
    arena.close()
    assert not arena.path.exists()  # the owner's does
    assert torch.equal(view, torch.arange(4, dtype=torch.float32))  # a view outlives close() without faulting
    with pytest.raises(ArenaError):
        arena.view(0, torch.uint8, (1,))
    with pytest.raises(ArenaError):
        Arena.attach(arena.path)


def test_arena_rejects_misuse() -> None:
    with Arena.create("misuse", 256) as arena:
        with Arena.create("misuse", 256) as again:  # the same prefix twice: two arenas (random names)
            assert again.path != arena.path
        with pytest.raises(ValueError):
            arena.view(2, torch.float32, (1,))  # misaligned
        with pytest.raises(ValueError):
            arena.view(0, torch.float32, (65,))  # past the end
        with Arena.attach(arena.path) as attached:
            with pytest.raises(RuntimeError):
                attached.alloc(8)  # only the owner allocates
            assert attached.pin_for_cuda() is False  # no CUDA here: a no-op
    assert not arena.path.exists()


def _create_arena_and_hang(queue: multiprocessing.Queue) -> None:
    arena = Arena.create("orphan", 4096)
    queue.put(str(arena.path))
    time.sleep(120)


def test_sweep_removes_only_arenas_of_dead_owners() -> None:
    queue = SPAWN.Queue()
    child = SPAWN.Process(target=_create_arena_and_hang, args=(queue,))
    before = _our_shm_files(os.getpid())
    child.start()
    try:
        orphan = Path(queue.get(timeout=120))
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join()  # reaped: a zombie would still count as alive
    live = Arena.create("live", 4096)
    assert orphan.exists()  # SIGKILL ran no cleanup

    removed = sweep_dead_arenas()

    assert orphan in removed
    assert not orphan.exists()
    assert live.path.exists() and live.path not in removed
    live.close()
    assert _our_shm_files(os.getpid(), child.pid) == before  # nothing of ours leaked


# ---------------------------------------------------------------- codec

_ints = st.integers(-(2**63), 2**63 - 1)
_shapes = st.lists(st.integers(0, 2**31), max_size=5).map(tuple)
_refs = st.builds(TensorRef, st.text(max_size=30), st.integers(0, 2**40), st.sampled_from(sorted(DTYPES)), _shapes)
_plain = st.recursive(
    st.one_of(_ints, st.floats(allow_nan=False), st.text(max_size=10), st.booleans(), st.none()),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=10,
)
_meta = st.dictionaries(st.text(max_size=10), _plain, max_size=5)
_tensors = st.dictionaries(st.text(max_size=10), _refs, max_size=4)
_messages = st.one_of(
    _refs,
    st.builds(OpRequest, _ints, st.text(max_size=10), _ints, _ints, _ints, _ints, _ints, _tensors, _meta),
    st.builds(OpResult, _ints, st.booleans(), _tensors, _meta, st.one_of(st.none(), st.text(max_size=20))),
    st.builds(ErrorReply, st.text(max_size=20)),
)


@settings(max_examples=150, deadline=None)
@given(_messages)
def test_codec_round_trips_every_message_type(msg: object) -> None:
    decoded = decode(encode(msg))
    assert type(decoded) is type(msg)
    assert decoded == msg


def test_codec_round_trip_literal() -> None:
    ref = TensorRef("specoffload-job-1-kv", 64, "bfloat16", (2, 3))
    req = OpRequest(7, "attention", step=3, layer=5, batch=1, token=42, slot=0, tensors={"q": ref}, meta={"k": [4]})
    decoded = decode(encode(req))
    assert decoded == req
    assert decoded.tensors["q"].shape == (2, 3)  # a tuple again, not a msgpack list
    assert decoded.tensors["q"].nbytes == 12


@message
@dataclass(frozen=True)
class _Probe:
    """A message with every kind of field the codec supports (registered once, for these tests)."""

    weights: float
    pair: tuple[int, str]
    refs: list[TensorRef]
    blob: bytes
    inner: OpResult | None


def test_new_message_types_register_with_the_decorator() -> None:
    ref = TensorRef("a", 0, "int64", (3,))
    probe = _Probe(1.5, (2, "x"), [ref, ref], b"\x00\xff", OpResult(4, meta={"n": [1, [2]]}))
    assert decode(encode(probe)) == probe
    assert decode(encode(_Probe(2, (1, "y"), [], b"", None))).weights == 2.0  # an int is a valid float
    with pytest.raises(WireError):
        encode(_Probe(1.0, (1, 2), [], b"", None))  # (int, str) expected
    with pytest.raises(TypeError):
        message(_Probe)  # the tag is taken

    @dataclass
    class Mutable:
        x: int

    @dataclass(frozen=True)
    class Untyped:
        x: object

    with pytest.raises(TypeError):
        message(Mutable)  # messages are frozen dataclasses
    with pytest.raises(TypeError):
        message(Untyped)  # with fields the codec can check


def _ext(*items: object) -> bytes:
    return msgpack.packb(msgpack.ExtType(1, msgpack.packb(list(items))))


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(pickle.dumps(OpResult(1)), id="pickle"),
        pytest.param(pickle.dumps({"op_id": 1}, protocol=0), id="pickle-protocol-0"),
        pytest.param(_ext("Unknown", 1), id="unknown-tag"),
        pytest.param(_ext("ErrorReply"), id="too-few-fields"),
        pytest.param(_ext("ErrorReply", "x", "y"), id="too-many-fields"),
        pytest.param(_ext("ErrorReply", 5), id="wrong-field-type"),
        pytest.param(_ext("TensorRef", "a", 0, "complex64", [2]), id="dtype-not-whitelisted"),
        pytest.param(_ext("TensorRef", "a", -64, "uint8", [2]), id="negative-offset"),
        pytest.param(_ext("OpResult", 1, True, {"t": 3}, {}, None), id="tensor-not-a-ref"),
        pytest.param(msgpack.packb(msgpack.ExtType(7, b"")), id="unknown-ext-type"),
        pytest.param(msgpack.packb(["OpResult", 1, True, {}, {}, None]), id="bare-array"),
        pytest.param(encode(OpResult(1)) + b"\x00", id="trailing-bytes"),
        pytest.param(encode(OpResult(1))[:-1], id="truncated"),
        pytest.param(b"", id="empty"),
    ],
)
def test_decode_rejects_malformed_input(data: bytes) -> None:
    with pytest.raises(WireError):
        decode(data)


def test_encode_rejects_what_the_peer_could_not_decode() -> None:
    with pytest.raises(WireError):
        TensorRef("a", 0, "float64", (1,))
    with pytest.raises(WireError):
        encode(OpRequest(1, "x", meta={"t": torch.zeros(1)}))  # tensors go through arenas
    with pytest.raises(WireError):
        encode(OpRequest(1, "x", meta={"nested": {"a": 1}}))
    with pytest.raises(WireError):
        encode(OpRequest(True, "x"))  # bool is not an int on the wire
    with pytest.raises(WireError):
        encode({"op_id": 1})
    assert isinstance(WireError("x"), SpecOffloadError)


@pytest.mark.parametrize("dtype", list(DTYPES.values()))
def test_write_and_read_tensor_are_exact(dtype: torch.dtype) -> None:
    source = (torch.randn(3, 5, 7) * 100).to(dtype).transpose(0, 2)  # [7, 5, 3], non-contiguous
    with Arena.create("tensors", 4096) as arena:
        region = arena.alloc(source.nbytes)
        ref = write_tensor(arena, region, source)
        view = read_tensor({arena.name: arena}, decode(encode(ref)))
        assert ref == TensorRef(arena.name, region.offset, str(dtype).removeprefix("torch."), (7, 5, 3))
        assert view.dtype == dtype and torch.equal(view, source)
        assert view.data_ptr() == arena.data.data_ptr() + region.offset  # a view of the arena, not a copy


def test_tensor_view_is_zero_copy_and_bounds_are_checked() -> None:
    with Arena.create("zerocopy", 4096) as arena:
        region = arena.alloc(64)
        ref, out = tensor_view(arena, region, torch.float32, (4, 4))
        torch.mul(torch.ones(4, 4), 3, out=out)  # the producer computes straight into the arena
        assert torch.equal(read_tensor({arena.name: arena}, ref), torch.full((4, 4), 3.0))
        with pytest.raises(ValueError):
            tensor_view(arena, region, torch.float32, (5, 4))  # larger than the region
        with pytest.raises(WireError):
            read_tensor({}, ref)  # an arena this process did not attach
        with pytest.raises(WireError):
            read_tensor({arena.name: arena}, TensorRef(arena.name, 4032, "float32", (32,)))  # past the end


# ---------------------------------------------------------------- channel


def test_channel_config_derives_addresses_and_guards_remote_binding(tmp_path: Path) -> None:
    cfg = ChannelConfig("verifier", socket_dir=str(tmp_path))
    assert cfg.pid == os.getpid()  # fixed at construction: a child that receives it derives the same address
    assert cfg.address == f"ipc://{tmp_path}/specoffload-{os.getpid()}-verifier.sock"
    assert ChannelConfig("x", pid=42, socket_dir="/run/u").address == "ipc:///run/u/specoffload-42-x.sock"
    assert ChannelConfig("x", transport="tcp", port=5555).address == "tcp://127.0.0.1:5555"
    assert ChannelConfig("x", transport="tcp", host="::1", port=5555).address == "tcp://[::1]:5555"
    assert ChannelConfig("x", transport="tcp", host="0.0.0.0", port=1, allow_remote=True).host == "0.0.0.0"
    for bad in (
        dict(transport="tcp", host="0.0.0.0", port=5555),
        dict(transport="tcp", host="10.1.2.3", port=5555),
        dict(transport="tcp", host="*", port=5555),
        dict(transport="tcp", port=None),
        dict(transport="udp"),
        dict(socket_dir="/" + "d" * 120),
        dict(spin_us=-1),
    ):
        with pytest.raises(ChannelConfigError):
            ChannelConfig("x", **bad)
    with pytest.raises(ChannelConfigError):
        ChannelConfig("a/b")


def _serve_sums(cfg: ChannelConfig, arena_path: str, requests: int) -> int:
    """Child: answer `requests` OpRequests by writing 2 * x into the request's "out" tensor."""
    arena = Arena.attach(arena_path)

    def handle(req: OpRequest) -> OpResult:
        x = read_tensor({arena.name: arena}, req.tensors["x"])
        torch.mul(x, 2, out=read_tensor({arena.name: arena}, req.tensors["out"]))
        return OpResult(req.op_id, meta={"sum": float(x.sum()), "pid": os.getpid()})

    with Server(cfg) as server:
        handled = sum(server.serve_once(handle, timeout_s=60) for _ in range(requests))
    arena.close()
    return handled


def test_request_reply_between_processes(other_process: ProcessPoolExecutor) -> None:
    cfg = ChannelConfig("sums")
    with Arena.create("channel", 4096) as arena, Client(cfg) as client:
        served = other_process.submit(_serve_sums, cfg, str(arena.path), 3)
        for op_id in range(3):
            x = write_tensor(arena, arena.alloc(16), torch.arange(4, dtype=torch.float32) + op_id)
            out, out_view = tensor_view(arena, arena.alloc(16), torch.float32, (4,))
            reply = client.call(OpRequest(op_id, "double", tensors={"x": x, "out": out}), timeout_s=120)
            assert reply.op_id == op_id and reply.meta["sum"] == 6.0 + 4 * op_id
            assert reply.meta["pid"] != os.getpid()
            assert torch.equal(out_view, 2 * (torch.arange(4, dtype=torch.float32) + op_id))
        assert served.result(timeout=60) == 3
    assert not cfg.socket_path.exists()  # the server's close removed its ipc file


def test_call_times_out_and_drops_the_late_reply(tmp_path: Path) -> None:
    cfg = ChannelConfig("silent", socket_dir=str(tmp_path))
    with Server(cfg) as server, Client(cfg) as client:
        start = time.monotonic()
        with pytest.raises(ChannelTimeout):
            client.call(OpRequest(1, "never answered in time"), timeout_s=0.1)
        assert time.monotonic() - start < 2.0

        def echo(req: OpRequest) -> OpResult:
            return OpResult(req.op_id)

        assert server.serve_once(echo, timeout_s=5)  # answers the abandoned request 1 now
        request = client.submit(OpRequest(2, "next"))
        assert server.serve_once(echo, timeout_s=5)
        assert client.wait(request, timeout_s=5).op_id == 2  # not the stale reply to 1
    with Client(ChannelConfig("nobody", socket_dir=str(tmp_path))) as orphan, pytest.raises(ChannelTimeout):
        orphan.call(OpRequest(3, "no server at all"), timeout_s=0.05)
    spinning = ChannelConfig("nobody", socket_dir=str(tmp_path), spin_us=200_000)  # spins longer than the timeout
    with Client(spinning) as orphan, pytest.raises(ChannelTimeout):
        start = time.monotonic()
        orphan.call(OpRequest(4, "no server, spinning"), timeout_s=0.05)
    assert time.monotonic() - start < 0.15  # the spin is capped by the timeout


def test_handler_errors_reach_the_caller_and_the_server_lives_on(tmp_path: Path) -> None:
    cfg = ChannelConfig("faulty", socket_dir=str(tmp_path))

    def handler(req: OpRequest) -> object:
        if req.kind == "raise":
            raise KeyError("missing layer")
        if req.kind == "bad reply":
            return torch.zeros(1)  # not a message: must not kill the server
        return OpResult(req.op_id)

    with Server(cfg) as server, Client(dataclasses.replace(cfg, spin_us=100)) as client:
        for kind, expected in (("raise", "KeyError"), ("bad reply", "WireError")):
            request = client.submit(OpRequest(1, kind))
            server.serve_once(handler, timeout_s=5)
            with pytest.raises(RemoteError, match=expected):
                client.wait(request, timeout_s=5)
        request = client.submit(OpRequest(2, "fine"))
        server.serve_once(handler, timeout_s=5)
        assert client.wait(request, timeout_s=5) == OpResult(2)


def test_ipc_address_in_use_is_refused_and_a_stale_one_reclaimed(tmp_path: Path) -> None:
    cfg = ChannelConfig("taken", socket_dir=str(tmp_path))
    with Server(cfg), pytest.raises(ChannelConfigError):
        Server(cfg)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(cfg.socket_path))  # a socket file nobody listens on, like one a SIGKILLed server leaves
    stale.close()
    assert cfg.socket_path.exists()
    with Server(cfg) as server:
        assert not server.closed
    assert not cfg.socket_path.exists()


def test_push_pull_one_way(tmp_path: Path) -> None:
    cfg = ChannelConfig("ops", socket_dir=str(tmp_path))
    with Puller(cfg) as puller, Pusher(cfg) as pusher:
        for op_id in range(3):
            pusher.send(OpRequest(op_id, "prefetch", layer=op_id))
        assert [puller.recv(timeout_s=5).layer for _ in range(3)] == [0, 1, 2]
        with pytest.raises(ChannelTimeout):
            puller.recv(timeout_s=0.05)


def test_serve_forever_stops_on_its_event(tmp_path: Path) -> None:
    cfg = ChannelConfig("loop", socket_dir=str(tmp_path))
    stop = threading.Event()
    with Server(cfg) as server, Client(cfg) as client:
        served: list[int] = []
        thread = threading.Thread(
            target=lambda: served.append(server.serve_forever(lambda r: OpResult(r.op_id), stop, poll_s=0.01))
        )
        thread.start()
        assert [client.call(OpRequest(i, "x"), timeout_s=5).op_id for i in range(5)] == list(range(5))
        stop.set()
        thread.join(timeout=5)
        assert not thread.is_alive() and served == [5]
