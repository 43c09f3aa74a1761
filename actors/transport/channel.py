"""ZeroMQ channels carrying `codec` messages between SpecOffload processes.

Server (ROUTER, binds) / Client (DEALER, connects): request/reply. Each request carries an 8-byte id that the
reply echoes, so a reply arriving after its call timed out is dropped instead of answering the next call (the
state trap of REQ sockets), and a client may keep several requests in flight (`submit` ... `wait`). A handler
that raises, or a request that does not decode, is answered with `ErrorReply`, which `Client.wait` raises as
`RemoteError`: no call hangs on a server-side bug.

Pusher (PUSH, connects) / Puller (PULL, binds): one-way dispatch, e.g. a stream of operations to a worker.

Sockets are not thread-safe: one socket object per thread. All sockets close with linger 0, and a binding
socket removes its ipc file on close.

What arrives on a socket is untrusted input: every socket refuses frames over `max_message_bytes` (ZeroMQ drops
the peer that sends one), a server answers any request it cannot decode with ErrorReply and serves on, an ipc
socket file is made owner-only (0600) right after bind, and a socket only binds over, or connects to, an ipc
file this user owns.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import zmq

from specoffload.planner.errors import SpecOffloadError

from .codec import MAX_MESSAGE_BYTES, ErrorReply, WireError, decode, encode

logger = logging.getLogger(__name__)

_MAX_UNIX_PATH = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
_ID_BYTES = 8

Handler = Callable[[Any], Any]
_S = TypeVar("_S", bound="_Socket")


class ChannelError(SpecOffloadError):
    """A channel cannot be set up or used."""


class ChannelConfigError(ChannelError, ValueError):
    """An invalid ChannelConfig: bad name, port or transport, or a non-loopback host without allow_remote."""


class ChannelTimeout(ChannelError, TimeoutError):
    """No reply (or no room to send) within the timeout: the peer is gone, stuck or not started."""


class RemoteError(ChannelError):
    """The server answered with ErrorReply: its handler raised or it could not decode the request."""


class _Event(Protocol):
    def is_set(self) -> bool: ...


@dataclass(frozen=True)
class ChannelConfig:
    """Where a channel lives. Addresses derive from (name, pid): `ipc://{socket_dir}/specoffload-{pid}-{name}.sock`.

    pid: the launching process's pid, fixed when the config is built (None: this process), so every process that
        receives the config derives the same address.
    socket_dir: ipc socket folder (None: $XDG_RUNTIME_DIR, else /tmp), also fixed at construction.
    transport "tcp": `tcp://{host}:{port}`; a host that is not loopback needs allow_remote=True (the wire carries
        no authentication).
    spin_us: a Client busy-polls this long for its reply before sleeping in poll: up to that much CPU per call,
        for one sleep/wake-up less when the reply comes fast (docs/perf/README.md, transport). Servers and
        pullers always sleep: an idle worker burns nothing.
    max_message_bytes: the largest frame the socket accepts (ZeroMQ's MAXMSGSIZE); a peer sending a larger one
        is disconnected.
    """

    name: str
    pid: int | None = None
    transport: Literal["ipc", "tcp"] = "ipc"
    host: str = "127.0.0.1"
    port: int | None = None
    allow_remote: bool = False
    socket_dir: str | None = None
    spin_us: int = 0
    max_message_bytes: int = MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        if self.pid is None:
            object.__setattr__(self, "pid", os.getpid())
        if self.socket_dir is None:
            object.__setattr__(self, "socket_dir", os.environ.get("XDG_RUNTIME_DIR") or "/tmp")
        if self.spin_us < 0:
            raise ChannelConfigError(f"spin_us must be >= 0, got {self.spin_us}")
        if self.max_message_bytes <= 0:
            raise ChannelConfigError(f"max_message_bytes must be positive, got {self.max_message_bytes}")
        if not self.name or not all(c.isalnum() or c in "_." for c in self.name):
            raise ChannelConfigError(f"channel name {self.name!r} must be non-empty [A-Za-z0-9_.]")
        if self.transport == "ipc":
            if len(str(self.socket_path)) > _MAX_UNIX_PATH:
                raise ChannelConfigError(f"ipc socket path {self.socket_path} exceeds {_MAX_UNIX_PATH} bytes")
        elif self.transport == "tcp":
            if self.port is None or not 0 < self.port < 65536:
                raise ChannelConfigError(f"tcp channel {self.name!r} needs a port in 1..65535, got {self.port}")
            if not self.allow_remote and not _is_loopback(self.host):
                raise ChannelConfigError(
                    f"channel {self.name!r} would be reachable from {self.host!r}; messages are not authenticated, "
                    "so binding beyond loopback needs allow_remote=True"
                )
        else:
            raise ChannelConfigError(f"transport must be 'ipc' or 'tcp', got {self.transport!r}")

    @property
    def socket_path(self) -> Path | None:
        if self.transport != "ipc":
            return None
        return Path(str(self.socket_dir)) / f"specoffload-{self.pid}-{self.name}.sock"

    @property
    def address(self) -> str:
        if self.transport == "ipc":
            return f"ipc://{self.socket_path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


class _Socket:
    """A zmq socket that binds or connects to a ChannelConfig's address; closes with linger 0."""

    def __init__(self, config: ChannelConfig, kind: int, bind: bool) -> None:
        self.config = config
        self._bound = bind
        if config.socket_path is not None and bind:
            _claim_ipc_path(config.socket_path)
        elif config.socket_path is not None:
            _check_ipc_owner(config.socket_path)
        self._sock = zmq.Context.instance().socket(kind)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        try:
            self._sock.bind(config.address) if bind else self._sock.connect(config.address)
            if bind and config.socket_path is not None:
                os.chmod(config.socket_path, 0o600)  # explicit, whatever the umask
        except (zmq.ZMQError, OSError) as e:
            self._sock.close(linger=0)
            raise ChannelError(f"cannot {'bind' if bind else 'connect'} {config.address}: {e}") from None

    @property
    def closed(self) -> bool:
        return self._sock.closed

    def close(self) -> None:
        if self._sock.closed:
            return
        self._sock.close(linger=0)
        if self._bound and self.config.socket_path is not None:
            self.config.socket_path.unlink(missing_ok=True)

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _poll(self, timeout_s: float, flags: int = zmq.POLLIN) -> bool:
        return bool(self._sock.poll(max(0, math.ceil(timeout_s * 1000)), flags))

    def _send(self, frames: list[bytes], timeout_s: float, what: str) -> None:
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # queue full (peer not reading): wait for room, up to the timeout
            if not self._poll(timeout_s, zmq.POLLOUT):
                raise ChannelTimeout(f"{self.config.address}: send queue full for {timeout_s:.3g}s ({what})") from None
            self._sock.send_multipart(frames, zmq.NOBLOCK)

    def _recv(self, timeout_s: float, spin_s: float = 0.0) -> list[bytes] | None:
        """The next message's frames, or None after `timeout_s`. Busy-polls for `spin_s` first."""
        if spin_s > 0:
            spin_until = time.perf_counter() + min(spin_s, timeout_s)
            while True:
                try:
                    return self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    if time.perf_counter() >= spin_until:
                        break
            timeout_s -= spin_s
        if not self._poll(timeout_s):
            return None
        return self._sock.recv_multipart(zmq.NOBLOCK)


class Server(_Socket):
    """Answers Client requests (ROUTER): one reply message per request message."""

    def __init__(self, config: ChannelConfig) -> None:
        super().__init__(config, zmq.ROUTER, bind=True)

    def serve_once(self, handler: Handler, timeout_s: float) -> bool:
        """Handle one request if one arrives within `timeout_s`; returns whether one did."""
        frames = self._recv(timeout_s)
        if frames is None:
            return False
        if len(frames) < 2 or len(frames[1]) != _ID_BYTES:
            logger.warning("%s: dropped a request with %d frames (not a Client?)", self.config.name, len(frames))
            return True
        if len(frames) != 3:  # correlatable, so answered: the sender learns what was wrong
            data = encode(ErrorReply(f"WireError: a request is 1 payload frame after its id, got {len(frames) - 2}"))
            self._send([frames[0], frames[1], data], 1.0, "client not reading")
            return True
        peer, request_id, payload = frames
        try:
            data = encode(handler(decode(payload)))
        except WireError as e:
            data = encode(ErrorReply(f"WireError: {e}"))
        except Exception as e:  # the handler's bug is reported to the caller and logged here; the server lives on
            logger.exception("%s: handler raised", self.config.name)
            data = encode(ErrorReply(f"{type(e).__name__}: {e}"))
        self._send([peer, request_id, data], 1.0, "client not reading")
        return True

    def serve_forever(self, handler: Handler, stop_event: _Event, poll_s: float = 0.05) -> int:
        """Serve until `stop_event` is set (checked every `poll_s`); returns the number of requests handled."""
        handled = 0
        while not stop_event.is_set():
            handled += self.serve_once(handler, poll_s)
        return handled


class Client(_Socket):
    """Sends requests to a Server (DEALER). `call` = `submit` + `wait`; several requests may be in flight."""

    def __init__(self, config: ChannelConfig) -> None:
        super().__init__(config, zmq.DEALER, bind=False)
        self._next_id = 0
        self._pending: set[int] = set()
        self._replies: dict[int, bytes] = {}

    def call(self, msg: Any, timeout_s: float) -> Any:
        return self.wait(self.submit(msg, timeout_s), timeout_s)

    def submit(self, msg: Any, timeout_s: float = 1.0) -> int:
        """Send a request; returns its id for `wait`."""
        data = encode(msg)
        self._send([(self._next_id + 1).to_bytes(_ID_BYTES, "big"), data], timeout_s, "server not reading")
        self._next_id += 1
        self._pending.add(self._next_id)
        return self._next_id

    def wait(self, request_id: int, timeout_s: float) -> Any:
        """The reply to request `request_id`; ChannelTimeout after `timeout_s` (the request is then abandoned)."""
        if request_id not in self._pending:
            raise ValueError(f"request {request_id} is not in flight")
        deadline = time.monotonic() + timeout_s
        while request_id not in self._replies:
            frames = self._recv(deadline - time.monotonic(), self.config.spin_us * 1e-6)
            if frames is None:
                self._pending.discard(request_id)  # a late reply will be dropped
                raise ChannelTimeout(f"{self.config.address}: no reply to request {request_id} in {timeout_s:.3g}s")
            if len(frames) == 2 and len(frames[0]) == _ID_BYTES:
                reply_id = int.from_bytes(frames[0], "big")
                if reply_id in self._pending:
                    self._replies[reply_id] = frames[1]
        self._pending.discard(request_id)
        reply = decode(self._replies.pop(request_id))
        if isinstance(reply, ErrorReply):
            raise RemoteError(f"{self.config.name}: {reply.error}")
        return reply


class Puller(_Socket):
    """Receives one-way messages (PULL, binds)."""

    def __init__(self, config: ChannelConfig) -> None:
        super().__init__(config, zmq.PULL, bind=True)

    def recv(self, timeout_s: float) -> Any:
        frames = self._recv(timeout_s)
        if frames is None:
            raise ChannelTimeout(f"{self.config.address}: nothing received in {timeout_s:.3g}s")
        if len(frames) != 1:
            raise WireError(f"{self.config.name}: expected one frame, got {len(frames)}")
        return decode(frames[0])


class Pusher(_Socket):
    """Sends one-way messages to a Puller (PUSH, connects)."""

    def __init__(self, config: ChannelConfig) -> None:
        super().__init__(config, zmq.PUSH, bind=False)

    def send(self, msg: Any, timeout_s: float = 1.0) -> None:
        self._send([encode(msg)], timeout_s, "puller not reading")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a hostname or "*": may resolve to anything
        return False


def _check_ipc_owner(path: Path) -> None:
    """Refuse an ipc socket file that another user owns (or that is not a socket): its server is not ours."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return  # not bound yet: ZeroMQ connects once it appears (and a server binds only over its own files)
    if st.st_uid != os.geteuid():
        raise ChannelError(f"ipc socket {path} belongs to uid {st.st_uid}, not to this user: refusing to use it")
    if not stat.S_ISSOCK(st.st_mode):
        raise ChannelError(f"{path} is not a socket: refusing to use it")


def _claim_ipc_path(path: Path) -> None:
    """Refuse an ipc path a live server listens on, or another user's file; remove one left by a dead server of
    ours (zmq would silently steal a live one)."""
    if not os.path.lexists(path):
        return
    _check_ipc_owner(path)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise ChannelConfigError(f"ipc socket {path} is in use by a live server")
