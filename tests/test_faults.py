"""Fault injection: bad input on sockets, hostile names and files in shared directories, corrupt checkpoints.

One section per item of the hardening review (transport, Ray roles, checkpoint reading); the README's "Threat
model" says what is trusted. Every test here failed (or crashed the interpreter) before the fix it covers.
Another user's files are made by chown where the tests run as root, and by making this user look like another
one (`os.geteuid` patched for one call) where they do not.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.synchronize import Event
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from scripts import get_models as gm
from specoffload.actors.transport import arena as arena_mod
from specoffload.actors.transport import codec
from specoffload.actors.transport.arena import SHM_DIR, Arena, ArenaError, ArenaFullError, ArenaName, sweep_dead_arenas
from specoffload.actors.transport.channel import ChannelConfig, ChannelError, Client, Server
from specoffload.actors.transport.codec import ErrorReply, OpRequest, OpResult, TensorRef, WireError, decode, encode
from specoffload.actors.transport.procs import pid_alive
from specoffload.actors.transport.shm import ARENA_TAG, ShmTensors, sweep_dead_sockets

SPAWN = multiprocessing.get_context("spawn")
NOBODY = 65534
ROOT = os.geteuid() == 0


def nested_ext_frame(depth: int) -> bytes:
    """An ErrorReply wrapped in `depth` message extensions: depth 250 is the 933-byte frame of the review."""
    frame = msgpack.packb(["ErrorReply", "x"])
    for _ in range(depth):
        frame = msgpack.packb(msgpack.ExtType(1, frame))
    return frame


def dead_pid() -> int:
    """The pid of a process that ran and was reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def zombie() -> Iterator[int]:
    """The pid of a child that exited and is not reaped yet (a zombie) until the test ends."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while pid_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.path.exists(f"/proc/{child.pid}")
    yield child.pid
    child.wait()


def as_another_user(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on this process believes it is another user: every file it made belongs to someone else."""
    uid = os.geteuid() + 1
    monkeypatch.setattr(os, "geteuid", lambda: uid)


def fake_arena_file(pid: int, tag: str = ARENA_TAG, ns: int | None = None, owner: int | None = None) -> Path:
    """An arena file named as if process `pid` had made it (in pid namespace `ns`), owned by `owner` if given."""
    name = ArenaName("fault", pid, tag) if ns is None else ArenaName("fault", pid, tag, ns)
    fd = os.open(name.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)
    if owner is not None:
        os.chown(name.path, owner, owner)
    return name.path


@pytest.fixture
def shm_files() -> Iterator[list[Path]]:
    """Files a test puts in /dev/shm, removed at its end whatever happened."""
    files: list[Path] = []
    yield files
    for path in files:
        path.unlink(missing_ok=True)


# ---------------------------------------------------------------- 1. malformed frames never kill a server


def _serve_echo(cfg: ChannelConfig, ready: Event, stop: Event) -> None:
    """Child: a server like a role's (`serve_forever` until stopped), answering OpRequests with OpResults."""
    with Server(cfg) as server:
        ready.set()
        server.serve_forever(lambda req: OpResult(req.op_id), stop, poll_s=0.05)


def _raw_request(address: str, frames: list[bytes], timeout_s: float) -> list[bytes] | None:
    """Send `frames` after an 8-byte request id from a raw DEALER; the reply's frames, or None."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart([(1).to_bytes(8, "big"), *frames])
        return sock.recv_multipart() if sock.poll(int(timeout_s * 1000)) else None
    finally:
        sock.close(linger=0)


def test_a_933_byte_frame_is_answered_with_a_wire_error_and_the_server_serves_on(tmp_path: Path) -> None:
    """Messages nested 250 deep used to overflow the C stack of msgpack's unpacker: a segfault of the server."""
    frame = nested_ext_frame(250)
    assert len(frame) == 933
    cfg = ChannelConfig("victim", socket_dir=str(tmp_path))
    ready, stop = SPAWN.Event(), SPAWN.Event()
    server = SPAWN.Process(target=_serve_echo, args=(cfg, ready, stop), daemon=True)
    server.start()
    try:
        assert ready.wait(120)
        reply = _raw_request(cfg.address, [frame], timeout_s=30)
        assert reply is not None, f"no answer (server exit code {server.exitcode})"
        error = decode(reply[1])
        assert isinstance(error, ErrorReply) and "WireError" in error.error and "nested" in error.error
        with Client(cfg) as client:
            assert client.call(OpRequest(7, "still there?"), timeout_s=30) == OpResult(7)
        assert server.is_alive()
    finally:
        stop.set()
        server.join(30)
        if server.is_alive():
            server.kill()


def _serve_attention_role(model: str, channel: multiprocessing.Queue, stop: Event) -> None:
    """Child: the attention role of a tiny llama, served on its own socket until `stop`."""
    from specoffload.actors.roles import Role
    from specoffload.runtime.config import EngineConfig
    from specoffload.runtime.engine import Engine

    config = EngineConfig(model, max_batch_size=3, max_seq_len=48, device_memory="1GiB", num_threads=1)
    role = Role("attention", config, 1)
    channel.put(role.setup(Engine(config).weight_plan).channel)
    stop.wait(300)
    role.shutdown()


@pytest.mark.slow
def test_a_role_answers_hostile_calls_and_serves_on(tiny_models: dict[str, Path], victim: Path) -> None:
    """The role server itself (a subprocess, as under Ray): the 933-byte frame, then a tensor header naming a
    file outside the arenas, are each answered with an error; then the role still does its work."""
    from specoffload.actors.transport.channel import RemoteError
    from specoffload.actors.transport.codec import WorkerCall

    channel, stop = SPAWN.Queue(), SPAWN.Event()
    role = SPAWN.Process(target=_serve_attention_role, args=(str(tiny_models["llama"]), channel, stop), daemon=True)
    role.start()
    try:
        cfg: ChannelConfig = channel.get(timeout=300)
        reply = _raw_request(cfg.address, [nested_ext_frame(250)], timeout_s=30)
        assert reply is not None, f"no answer (role exit code {role.exitcode})"
        assert "WireError" in decode(reply[1]).error
        with Client(cfg) as client:
            hostile = TensorRef(os.path.relpath(victim, SHM_DIR), 0, "int64", (1,))
            with pytest.raises(RemoteError, match="not an arena name"):
                client.call(WorkerCall("embed", tensors={"token_ids": hostile}), timeout_s=30)
            client.call(WorkerCall("reset", scalars={"batch": 0, "rows": 2, "capacity": 8}), timeout_s=30)
            assert client.call(WorkerCall("lengths", scalars={"batch": 0}), timeout_s=30).values == ([0, 0],)
        assert role.is_alive()
    finally:
        stop.set()
        role.join(30)
        if role.is_alive():
            role.kill()


@pytest.mark.parametrize("depth", [9, 20, 100])  # deeper crashed the old decoder in-process: see above
def test_decode_bounds_the_nesting_of_messages(depth: int) -> None:
    with pytest.raises(WireError, match="nested more than"):
        decode(nested_ext_frame(depth))
    assert decode(nested_ext_frame(1)) == ErrorReply("x")


def test_decode_bounds_the_size_before_unpacking(monkeypatch: pytest.MonkeyPatch) -> None:
    data = encode(OpRequest(1, "x" * 200))
    monkeypatch.setattr(codec, "MAX_MESSAGE_BYTES", 100)
    with pytest.raises(WireError, match="exceeds the 100-byte limit"):
        decode(data)


def test_plain_lists_nest_only_so_deep() -> None:
    deep: list = [1]
    for _ in range(codec.MAX_LIST_DEPTH + 1):
        deep = [deep]
    with pytest.raises(WireError):
        encode(OpRequest(1, "x", meta={"deep": deep}))
    payload = msgpack.packb(["OpRequest", 1, "x", 0, 0, 0, 0, 0, {}, {"deep": deep}])
    with pytest.raises(WireError):
        decode(msgpack.packb(msgpack.ExtType(1, payload)))
    shallow = OpRequest(1, "x", meta={"rows": [[1, 2], [3]]})
    assert decode(encode(shallow)) == shallow


def test_sockets_refuse_frames_over_their_size_limit(tmp_path: Path) -> None:
    cfg = ChannelConfig("small", socket_dir=str(tmp_path), max_message_bytes=4096)

    def echo(req: OpRequest) -> OpResult:
        return OpResult(req.op_id)

    with Server(cfg) as server:
        with Client(cfg) as big:
            big.submit(OpRequest(1, "x" * 10_000))
            assert not server.serve_once(echo, timeout_s=0.5)  # ZeroMQ dropped the frame (and the peer)
        with Client(cfg) as client:
            request = client.submit(OpRequest(2, "fine"))
            assert server.serve_once(echo, timeout_s=5)
            assert client.wait(request, timeout_s=5) == OpResult(2)


def test_a_request_with_extra_frames_is_answered(tmp_path: Path) -> None:
    cfg = ChannelConfig("frames", socket_dir=str(tmp_path))
    with Server(cfg) as server:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(cfg.address)
        try:
            sock.send_multipart([(5).to_bytes(8, "big"), encode(OpRequest(5, "x")), b"extra"])
            assert server.serve_once(lambda req: OpResult(req.op_id), timeout_s=5)
            assert sock.poll(5000)
            request_id, data = sock.recv_multipart()
        finally:
            sock.close(linger=0)
    assert int.from_bytes(request_id, "big") == 5
    assert "WireError" in decode(data).error


# ---------------------------------------------------------------- 2. arena names from the wire pick no file


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim"
    path.write_bytes(b"secret!!" * 512)
    return path


def test_tensor_refs_cannot_name_a_file_outside_the_runtimes_arenas(victim: Path) -> None:
    shm = ShmTensors("faults")
    try:
        for name in (os.path.relpath(victim, SHM_DIR), str(victim), f"specoffload-{ARENA_TAG}-1-1-x-0123abcd/../x"):
            with pytest.raises(WireError, match="not an arena name"):
                shm.read(TensorRef(name, 0, "uint8", (8,)))
        other_job = ArenaName("x", os.getpid(), "otherjob").filename
        with pytest.raises(WireError, match="not an arena name of job"):
            shm.read(TensorRef(other_job, 0, "uint8", (8,)))
    finally:
        shm.close()


def test_a_well_named_symlink_is_not_followed(victim: Path, shm_files: list[Path]) -> None:
    link = ArenaName("link", os.getpid(), ARENA_TAG).path
    link.symlink_to(victim)
    shm_files.append(link)
    shm = ShmTensors("faults")
    try:
        with pytest.raises(ArenaError, match="cannot attach"):
            shm.read(TensorRef(link.name, 0, "uint8", (8,)))
    finally:
        shm.close()


def test_attach_maps_only_this_users_regular_files(shm_files: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    with Arena.create("mine", 4096, ARENA_TAG) as arena:
        as_another_user(monkeypatch)
        with pytest.raises(ArenaError, match="belongs to uid"):
            Arena.attach(arena.path)


# ---------------------------------------------------------------- 3. sweeps: own tag, own namespace, own files


def test_sweep_removes_only_this_jobs_dead_files_in_this_namespace(shm_files: list[Path]) -> None:
    pid = dead_pid()
    shm_files.append(ours := fake_arena_file(pid, "faultjob"))
    shm_files.append(other_tag := fake_arena_file(pid, "otherjob"))
    ns = arena_mod.pid_namespace() + 1
    shm_files.append(other_ns := fake_arena_file(pid, "faultjob", ns=ns))  # another container's live arena

    removed = sweep_dead_arenas("faultjob")

    assert removed == [ours] and not ours.exists()
    assert other_tag.exists() and other_ns.exists()


def test_sweep_keeps_other_users_files(shm_files: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    pid = dead_pid()
    shm_files.append(fake_arena_file(pid, "faultjob"))
    if ROOT:
        shm_files.append(fake_arena_file(pid, "faultjob", owner=NOBODY))
        assert sweep_dead_arenas("faultjob") == [shm_files[0]]
        assert shm_files[1].exists()
    else:
        with monkeypatch.context() as patch:
            as_another_user(patch)
            assert sweep_dead_arenas("faultjob") == []
        assert shm_files[0].exists()


def test_sweeps_skip_what_they_may_not_remove(
    tmp_path: Path, shm_files: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    pid = dead_pid()
    arena_file = fake_arena_file(pid, "faultjob")
    shm_files.append(arena_file)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock_file = tmp_path / f"specoffload-{pid}-gone.sock"
    stale.bind(str(sock_file))
    stale.close()
    unlink = os.unlink

    def refuse(path: object, *args: object, **kwargs: object) -> None:
        if Path(str(path)) in (arena_file, sock_file):
            raise PermissionError(1, "Operation not permitted", str(path))
        unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuse)
    assert sweep_dead_arenas("faultjob") == []
    assert sweep_dead_sockets(tmp_path) == []
    assert arena_file.exists() and sock_file.exists()


def test_sweep_counts_a_zombie_owner_as_dead(zombie: int, shm_files: list[Path]) -> None:
    orphan = fake_arena_file(zombie, "faultjob")
    shm_files.append(orphan)
    assert sweep_dead_arenas("faultjob") == [orphan]


def test_a_squatted_arena_name_is_skipped_and_reported_truthfully(
    shm_files: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    nonces = ["aaaaaaaa"]
    monkeypatch.setattr(arena_mod, "_new_nonce", lambda: nonces.pop(0))
    squat = fake_arena_file(os.getpid(), "faultjob", owner=NOBODY if ROOT else None)
    shm_files.append(squat)
    nonces += ["aaaaaaaa", "bbbbbbbb"]  # the squatter guessed the first name the arena tries
    with Arena.create("fault", 4096, "faultjob") as arena:
        assert arena.path.name.endswith("-bbbbbbbb") and squat.exists()
    monkeypatch.setattr(arena_mod, "_new_nonce", lambda: "aaaaaaaa")  # it guesses every name
    with pytest.raises(ArenaError, match="is taken") as info:
        Arena.create("fault", 4096, "faultjob")
    assert "created twice" not in str(info.value)
    if ROOT:
        assert f"uid {NOBODY}" in str(info.value)


def test_socket_files_are_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        with Server(ChannelConfig("perm", socket_dir=str(tmp_path))) as server:
            assert stat.S_IMODE(os.stat(server.config.socket_path).st_mode) == 0o600
    finally:
        os.umask(old)


def test_clients_and_servers_refuse_another_users_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ChannelConfig("theirs", socket_dir=str(tmp_path))
    with Server(cfg), monkeypatch.context() as patch:
        as_another_user(patch)
        with pytest.raises(ChannelError, match="belongs to uid"):
            Client(cfg)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(cfg.socket_path))
    stale.close()
    as_another_user(monkeypatch)
    with pytest.raises(ChannelError, match="belongs to uid"):
        Server(cfg)
    assert cfg.socket_path.exists()


def test_socket_sweep_keeps_a_live_server_whose_pid_is_not_ours(tmp_path: Path) -> None:
    """A server in another pid namespace (or one whose pid was reused) still answers: its socket stays."""
    cfg = ChannelConfig("elsewhere", pid=dead_pid(), socket_dir=str(tmp_path))
    with Server(cfg):
        assert sweep_dead_sockets(tmp_path) == []
        assert cfg.socket_path.exists()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(cfg.socket_path))
    stale.close()
    assert sweep_dead_sockets(tmp_path) == [cfg.socket_path]


# ---------------------------------------------------------------- 5. converted checkpoints are checked by hash


@pytest.fixture
def converted(tmp_path: Path) -> Path:
    """A cache directory shaped like a conversion's output, provenance (with hashes) included."""
    spec = gm.SPECS["draft"]
    directory = tmp_path / spec.name
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"weights" * 100)
    gm.write_provenance(directory, spec, {})
    return directory


def test_provenance_records_the_safetensors_hashes(converted: Path) -> None:
    record = json.loads((converted / gm.PROVENANCE).read_text())
    assert record[gm.HASHES] == {"model.safetensors": gm.sha256_file(converted / "model.safetensors")}
    assert gm.model_dir("draft", converted.parent) == converted  # checked, and fine


def test_a_modified_checkpoint_is_refused(converted: Path) -> None:
    (converted / "model.safetensors").write_bytes(b"tampered" * 100)
    with pytest.raises(gm.CheckpointHashError, match="model.safetensors changed"):
        gm.model_dir("draft", converted.parent)
    (converted / "extra.safetensors").write_bytes(b"")
    (converted / "model.safetensors").unlink()
    with pytest.raises(gm.CheckpointHashError, match="extra.safetensors not recorded, model.safetensors missing"):
        gm.verify_checkpoint(converted)


def test_the_hash_check_can_be_skipped_and_says_what_it_skips(
    converted: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (converted / "model.safetensors").write_bytes(b"tampered")
    monkeypatch.setenv(gm.SKIP_HASH_ENV, "1")
    assert gm.model_dir("draft", converted.parent) == converted
    err = capsys.readouterr().err
    assert "NOT checking the SHA-256" in err and "1 safetensors files" in err


def test_an_old_cache_is_hashed_once_and_recorded(converted: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record_path = converted / gm.PROVENANCE
    record = json.loads(record_path.read_text())
    del record[gm.HASHES]
    record_path.write_text(json.dumps(record))
    gm.verify_checkpoint(converted)
    assert "recorded the SHA-256" in capsys.readouterr().err
    assert json.loads(record_path.read_text())[gm.HASHES] == {
        "model.safetensors": gm.sha256_file(converted / "model.safetensors")
    }


# ---------------------------------------------------------------- 6. output arenas are bounded


def test_output_arenas_stay_under_their_limit() -> None:
    shm = ShmTensors("bounded", max_bytes=1 << 20)
    try:
        shm.write("a", torch.zeros(400_000, dtype=torch.uint8))
        shm.write("b", torch.zeros(300_000, dtype=torch.uint8))
        shm.write("a", torch.zeros(450_000, dtype=torch.uint8))  # doubling a's arena would pass the limit
        assert shm.own_bytes <= 1 << 20
        with pytest.raises(ArenaFullError, match="over their limit"):
            shm.write("c", torch.zeros(300_000, dtype=torch.uint8))
        assert shm.own_bytes <= 1 << 20
    finally:
        shm.close()


def test_an_output_arena_shrinks_after_a_burst() -> None:
    shm = ShmTensors("shrinks", max_bytes=64 << 20)
    try:
        shm.write("k", torch.zeros(8 << 20, dtype=torch.uint8))  # one large result (a prefill, say)
        big = shm.own_bytes
        for _ in range(40):
            ref = shm.write("k", torch.ones(1000, dtype=torch.uint8))  # then small ones
        assert shm.own_bytes < big // 4
        assert torch.equal(shm.read(ref), torch.ones(1000, dtype=torch.uint8))
    finally:
        shm.close()
