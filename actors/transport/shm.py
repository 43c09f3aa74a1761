"""The shared-memory tensors of one process (`ShmTensors`), and the sweep of dead processes' ipc sockets.

Used by the actor roles and by the coordinator's proxies (actors/): each process writes tensors only into arenas
it owns, one arena per output key, reused call after call, replaced by a larger one when a result outgrows it and
by a smaller one when its results have long stayed far smaller; all of a process's output arenas together stay
under `max_bytes`. It reads other processes' tensors by attaching their arenas on first sight, and only arenas
whose names the runtime itself makes for its job: a `TensorRef` arrives on a socket, and its arena name must not
pick a file to map.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections.abc import Hashable
from pathlib import Path

import torch

from .arena import SHM_DIR, Arena, ArenaFullError, ArenaName, Region
from .codec import TensorRef, WireError, read_tensor, tensor_view
from .procs import pid_alive

#: the job tag of every arena the actor runtime creates (see arena.py ArenaName)
ARENA_TAG = "actors"
_MIN_ARENA = 64 << 10
_PAGE = 4096
#: a key's arena shrinks when `_SHRINK_AFTER` writes in a row all used under 1/`_SHRINK_RATIO` of it
_SHRINK_AFTER = 32
_SHRINK_RATIO = 4


def default_max_bytes(shm_dir: Path = SHM_DIR) -> int:
    """A quarter of the shared-memory filesystem: the output arenas of one process may hold at most this much."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return 1 << 30
    return max(st.f_blocks * st.f_frsize // 4, 16 * _MIN_ARENA)


class ShmTensors:
    """The shared-memory tensors of one process: own output arenas by key, and other processes' arenas attached.

    `write(key, tensor)` copies into the arena of `key` and returns its header; the previous tensor under that key
    is overwritten, so a key must not be reused while a reader may still look at it. An arena that is too small is
    replaced by one twice as large (at most what `max_bytes` leaves), one far too large for its recent results by
    a smaller one; a write that would take the own arenas past `max_bytes` (default: `default_max_bytes`) raises
    ArenaFullError. `read(ref)` is a zero-copy view of any arena of job `tag`; other names raise WireError.
    Thread-safe.
    """

    def __init__(self, prefix: str, tag: str = ARENA_TAG, max_bytes: int | None = None) -> None:
        self.prefix, self.tag = prefix, tag
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self._own: dict[Hashable, Arena] = {}
        self._by_name: dict[str, Arena] = {}  # own and attached arenas by file name
        self._recent: dict[Hashable, tuple[int, int]] = {}  # key -> (largest of the recent writes, their count)
        self._count = 0
        self._lock = threading.Lock()

    def write(self, key: Hashable, tensor: torch.Tensor) -> TensorRef:
        nbytes = tensor.numel() * tensor.element_size()
        arena = self._own.get(key)
        if arena is None or arena.nbytes < nbytes:
            arena = self._replace(key, nbytes, grow=True)
        elif self._oversized(key, arena, nbytes):
            arena = self._replace(key, self._recent.pop(key)[0], grow=False)
        ref, view = tensor_view(arena, Region(0, arena.nbytes), tensor.dtype, tuple(tensor.shape))
        view.copy_(tensor)
        return ref

    def read(self, ref: TensorRef) -> torch.Tensor:
        if ref.arena not in self._by_name:
            self._attach(ref.arena)
        return read_tensor(self._by_name, ref)

    @property
    def paths(self) -> list[Path]:
        """Files of the arenas this process owns."""
        return [arena.path for arena in self._own.values()]

    @property
    def own_bytes(self) -> int:
        """Bytes of shared memory the own arenas hold."""
        return sum(arena.nbytes for arena in self._own.values())

    def close(self) -> None:
        """Unlink the own arenas and unmap everything (views handed out stay valid until freed)."""
        with self._lock:
            for arena in self._by_name.values():
                arena.close()
            self._own.clear()
            self._by_name.clear()
            self._recent.clear()

    def _oversized(self, key: Hashable, arena: Arena, nbytes: int) -> bool:
        """Record a write of `nbytes`; True when the recent writes all fit a small fraction of `key`'s arena."""
        peak, count = self._recent.get(key, (0, 0))
        peak, count = max(peak, nbytes), count + 1
        if count < _SHRINK_AFTER:
            self._recent[key] = (peak, count)
            return False
        self._recent[key] = (peak, 0)
        if arena.nbytes <= _SHRINK_RATIO * max(peak, _MIN_ARENA):
            self._recent.pop(key)
            return False
        return True

    def _replace(self, key: Hashable, nbytes: int, grow: bool) -> Arena:
        with self._lock:
            old = self._own.get(key)
            others = self.own_bytes - (old.nbytes if old is not None else 0)
            need = _page_up(max(nbytes, _MIN_ARENA))
            if others + need > self.max_bytes:
                raise ArenaFullError(
                    f"a {nbytes}-byte result would take the output arenas of {self.prefix!r} to {others + need} "
                    f"bytes of shared memory, over their limit of {self.max_bytes} (ShmTensors max_bytes)"
                )
            if not grow:
                want = 2 * need  # headroom above the recent results
            elif old is not None:
                want = 2 * old.nbytes  # doubling: few replacements while results grow
            else:
                want = need
            size = max(need, min(_page_up(want), (self.max_bytes - others) // _PAGE * _PAGE))
            arena = Arena.create(f"{self.prefix}.{self._count}", size, self.tag)
            self._count += 1
            if old is not None:
                del self._by_name[old.name]
                old.close()  # unlinks; a reader that attached it keeps its mapping until it prunes it
            self._own[key] = self._by_name[arena.name] = arena
            return arena

    def _attach(self, name: str) -> None:
        parsed = ArenaName.parse(name)
        if parsed is None or parsed.tag != self.tag:
            raise WireError(f"tensor in {name!r:.120}, which is not an arena name of job {self.tag!r}: refused")
        with self._lock:
            if name in self._by_name:
                return
            for old in [a for a in self._by_name.values() if not a.owner and not a.path.exists()]:
                del self._by_name[old.name]  # replaced or owner gone: drop the stale mapping
                old.close()
            self._by_name[name] = Arena.attach(SHM_DIR / name)


def sweep_dead_sockets(socket_dir: str | Path) -> list[Path]:
    """Remove ipc socket files `specoffload-{pid}-{name}.sock` whose pid is gone (a killed role leaves its own).

    Only sockets this user owns are candidates, a socket a live server still answers on is kept (its pid may
    belong to another pid namespace), and one that cannot be removed is skipped: the sweep never raises.
    """
    removed = []
    uid = os.geteuid()
    try:
        paths = sorted(Path(socket_dir).glob("specoffload-*-*.sock"))
    except OSError:
        return removed
    for path in paths:
        pid = path.name.split("-")[1]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        try:
            st = os.lstat(path)
            if st.st_uid != uid or not stat.S_ISSOCK(st.st_mode) or _answers(path):
                continue
            os.unlink(path)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        removed.append(path)
    return removed


def _answers(path: Path) -> bool:
    """Does a server listen on the unix socket `path`?"""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _page_up(n: int) -> int:
    return -(-n // _PAGE) * _PAGE
