"""The shared-memory tensors of one process (`ShmTensors`), and the sweep of dead processes' ipc sockets.

Used by the actor roles and by the coordinator's proxies (actors/): each process writes tensors only into arenas
it owns, one arena per output key, reused call after call and replaced by a larger one when a result outgrows it;
it reads other processes' tensors by attaching their arenas on first sight.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from pathlib import Path

import torch

from .arena import SHM_DIR, Arena, Region
from .codec import TensorRef, read_tensor, tensor_view
from .procs import pid_alive

#: the job tag of every arena the actor runtime creates (see arena.py ArenaName)
ARENA_TAG = "actors"
_MIN_ARENA = 64 << 10
_PAGE = 4096


class ShmTensors:
    """The shared-memory tensors of one process: own output arenas by key, and other processes' arenas attached.

    `write(key, tensor)` copies into the arena of `key` (created, or replaced by one twice as large, when the
    tensor does not fit) and returns its header; the previous tensor under that key is overwritten, so a key
    must not be reused while a reader may still look at it. `read(ref)` is a zero-copy view of any arena.
    Thread-safe.
    """

    def __init__(self, prefix: str, tag: str = ARENA_TAG) -> None:
        self.prefix, self.tag = prefix, tag
        self._own: dict[Hashable, Arena] = {}
        self._by_name: dict[str, Arena] = {}  # own and attached arenas by file name
        self._count = 0
        self._lock = threading.Lock()

    def write(self, key: Hashable, tensor: torch.Tensor) -> TensorRef:
        nbytes = tensor.numel() * tensor.element_size()
        arena = self._own.get(key)
        if arena is None or arena.nbytes < nbytes:
            arena = self._replace(key, nbytes)
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

    def close(self) -> None:
        """Unlink the own arenas and unmap everything (views handed out stay valid until freed)."""
        with self._lock:
            for arena in self._by_name.values():
                arena.close()
            self._own.clear()
            self._by_name.clear()

    def _replace(self, key: Hashable, nbytes: int) -> Arena:
        with self._lock:
            old = self._own.get(key)
            size = max(nbytes, 2 * old.nbytes if old is not None else 0, _MIN_ARENA)
            arena = Arena.create(f"{self.prefix}.{self._count}", -(-size // _PAGE) * _PAGE, self.tag)
            self._count += 1
            if old is not None:
                del self._by_name[old.name]
                old.close()  # unlinks; a reader that attached it keeps its mapping until it prunes it
            self._own[key] = self._by_name[arena.name] = arena
            return arena

    def _attach(self, name: str) -> None:
        with self._lock:
            if name in self._by_name:
                return
            for old in [a for a in self._by_name.values() if not a.owner and not a.path.exists()]:
                del self._by_name[old.name]  # replaced or owner gone: drop the stale mapping
                old.close()
            self._by_name[name] = Arena.attach(SHM_DIR / name)


def sweep_dead_sockets(socket_dir: str | Path) -> list[Path]:
    """Remove ipc socket files `specoffload-{pid}-{name}.sock` whose pid is gone (a killed role leaves its own)."""
    removed = []
    for path in Path(socket_dir).glob("specoffload-*-*.sock"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and not pid_alive(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


