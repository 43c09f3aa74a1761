"""Shared-memory arenas with exactly one owner.

An arena is a file under /dev/shm named `specoffload-{tag}-{pidns}-{pid}-{name}-{nonce}` (see `ArenaName`), mapped
into every process that uses it as one flat uint8 tensor. The creating process owns it: only the owner allocates
regions, and its `close()` (or its weakref finalizer, which also runs at interpreter exit) unlinks the file. Other
processes `attach` by path and only unmap. A process killed before it could clean up leaves its file behind;
`sweep_dead_arenas` removes the files whose owner pid is gone, and every process that creates arenas runs it
once per tag before its first `Arena.create` of that tag.

/dev/shm is shared by every user of the machine, and by containers started with --ipc=host (each with its own pid
namespace). So the sweep only touches files of this user (by the file's owner, not its name) and of this pid
namespace (the namespace is in the name: a pid means nothing outside it), and skips whatever it may not remove;
names carry a random nonce, so nobody can squat the name an arena is about to take; files are created 0600 with
O_EXCL | O_NOFOLLOW, and `attach` maps only regular files this user owns.

Mappings are released by reference counting, never explicitly: `close()` drops the arena's reference, and a
view handed out earlier keeps its pages mapped until it is freed, so a stale view reads stale data but never
faults.
"""

from __future__ import annotations

import bisect
import errno
import functools
import mmap
import os
import re
import secrets
import stat
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specoffload.planner.errors import SpecOffloadError

from .procs import pid_alive

SHM_DIR = Path("/dev/shm")
PREFIX = "specoffload-"
_PART = r"[A-Za-z0-9_.]+"
_NAME_RE = re.compile(
    rf"{PREFIX}(?P<tag>{_PART})-(?P<ns>[0-9]+)-(?P<pid>[0-9]+)-(?P<name>{_PART})-(?P<nonce>[0-9a-f]{{8,32}})"
)
_CREATE_ATTEMPTS = 4  # fresh nonces tried when a name is taken (by chance, or by someone squatting /dev/shm)
_CUDA_HOST_REGISTER_PORTABLE = 1


class ArenaError(SpecOffloadError):
    """An arena cannot be created, attached or used (missing file, /dev/shm full, closed arena)."""


class ArenaFullError(ArenaError):
    """No free region of the requested size is left in the arena: it was sized too small for the workload."""


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not say): pids mean something only inside it."""
    return _pid_namespace(os.getpid())


@functools.cache
def _pid_namespace(_pid: int) -> int:  # keyed by pid: a forked child may live in another namespace
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _new_nonce() -> str:
    return secrets.token_hex(4)


@dataclass(frozen=True)
class ArenaName:
    """The /dev/shm file name of an arena: `specoffload-{tag}-{ns}-{pid}-{prefix}-{nonce}`.

    prefix: what the arena holds ("kv", "weights", ...); tag: the job it belongs to; ns: the owner's pid namespace
    and pid: the owner's pid, which `sweep_dead_arenas` reads back to decide whether the file is orphaned (only
    within its own namespace); nonce: random hex, so the name cannot be guessed (and squatted) in advance. Parts use
    [A-Za-z0-9_.] only, so the name parses back unambiguously.
    """

    prefix: str
    pid: int
    tag: str = "job"
    ns: int = field(default_factory=pid_namespace)
    nonce: str = field(default_factory=lambda: _new_nonce())  # looked up per call (tests replace it)

    def __post_init__(self) -> None:
        for part, value in (("prefix", self.prefix), ("tag", self.tag)):
            if not re.fullmatch(_PART, value):
                raise ValueError(f"arena {part} {value!r} must match {_PART}")
        if self.pid <= 0:
            raise ValueError(f"arena pid must be positive, got {self.pid}")
        if self.ns < 0 or not re.fullmatch(r"[0-9a-f]{8,32}", self.nonce):
            raise ValueError(f"bad arena namespace {self.ns} or nonce {self.nonce!r}")

    @property
    def filename(self) -> str:
        return f"{PREFIX}{self.tag}-{self.ns}-{self.pid}-{self.prefix}-{self.nonce}"

    @property
    def path(self) -> Path:
        return SHM_DIR / self.filename

    @classmethod
    def parse(cls, filename: str) -> ArenaName | None:
        """The name a file of ours carries, or None for anything else in /dev/shm (paths, other formats)."""
        m = _NAME_RE.fullmatch(filename)
        if m is None or int(m["pid"]) <= 0:
            return None
        return cls(m["name"], int(m["pid"]), m["tag"], int(m["ns"]), m["nonce"])


@dataclass(frozen=True)
class Region:
    """`nbytes` bytes at byte `offset` of an arena."""

    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class FirstFitAllocator:
    """First-fit allocation of byte ranges in [0, capacity), with coalescing on free."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # sorted, disjoint, non-adjacent [start, end)
        self._used: dict[int, int] = {}  # offset -> nbytes

    @property
    def free_bytes(self) -> int:
        return sum(end - start for start, end in self._free)

    def alloc(self, nbytes: int, align: int = 64) -> Region:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if align < 1 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        size = max(nbytes, 1)  # distinct offsets even for empty tensors
        for i, (start, end) in enumerate(self._free):
            offset = -(-start // align) * align
            if offset + size <= end:
                pieces = [(s, e) for s, e in ((start, offset), (offset + size, end)) if e > s]
                self._free[i : i + 1] = pieces
                self._used[offset] = size
                return Region(offset, size)
        raise ArenaFullError(
            f"no free region of {size} bytes (align {align}) in an arena of {self.capacity} bytes "
            f"({self.free_bytes} free, fragmented into {len(self._free)} ranges)"
        )

    def free(self, region: Region) -> None:
        if self._used.get(region.offset) != region.nbytes:
            raise ValueError(f"{region} is not an allocated region (double free?)")
        del self._used[region.offset]
        start, end = region.offset, region.end
        i = bisect.bisect_left(self._free, (start, end))
        if i < len(self._free) and self._free[i][0] == end:  # merge with the next free range
            end = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == start:  # and with the previous one
            start = self._free.pop(i - 1)[0]
            i -= 1
        self._free.insert(i, (start, end))


class Arena:
    """A shared-memory file mapped as a flat uint8 tensor. Use `Arena.create` (owner) or `Arena.attach`."""

    def __init__(self, path: Path, mm: mmap.mmap, owner: bool) -> None:
        self.path = path
        self.nbytes = len(mm)
        self.owner = owner
        self._data: torch.Tensor | None = torch.frombuffer(mm, dtype=torch.uint8)  # [nbytes], holds mm alive
        self._allocator = FirstFitAllocator(self.nbytes) if owner else None
        self._pinned_ptr: int | None = None
        # Runs on close(), on garbage collection and at interpreter exit; unlinks only in the owning process.
        self._finalizer = weakref.finalize(self, _unlink_if_owner, str(path) if owner else None, os.getpid())

    @classmethod
    def create(cls, name_prefix: str, nbytes: int, owner_tag: str | None = None) -> Arena:
        """Create and own a new arena of `nbytes` bytes, backed by memory reserved up front."""
        if nbytes <= 0:
            raise ValueError(f"arena size must be positive, got {nbytes}")
        tag = owner_tag or "job"
        _sweep_once(tag)
        fd, path = _create_file(name_prefix, tag)
        try:
            _reserve(fd, nbytes, path)
            mm = mmap.mmap(fd, nbytes)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return cls(path, mm, owner=True)

    @classmethod
    def attach(cls, path: str | Path) -> Arena:
        """Map an existing arena read/write without owning it: `close()` only unmaps."""
        path = Path(path)
        try:  # never O_CREAT: attaching must not resurrect an unlinked arena; never through a symlink
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise ArenaError(f"arena {path} does not exist (its owner closed it or died)") from None
        except OSError as e:
            raise ArenaError(f"cannot attach arena {path}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ArenaError(f"arena {path} is not a regular file")
            if st.st_uid != os.geteuid():
                raise ArenaError(f"arena {path} belongs to uid {st.st_uid}, not to this user: refusing to map it")
            nbytes = st.st_size
            if nbytes == 0:
                raise ArenaError(f"arena {path} is empty")
            mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        return cls(path, mm, owner=False)

    @property
    def name(self) -> str:
        """The key `TensorRef.arena` uses for this arena."""
        return self.path.name

    @property
    def closed(self) -> bool:
        return self._data is None

    @property
    def data(self) -> torch.Tensor:
        """The whole mapping, [nbytes] uint8."""
        if self._data is None:
            raise ArenaError(f"arena {self.name} is closed")
        return self._data

    @property
    def free_bytes(self) -> int:
        return self._owned_allocator().free_bytes

    def alloc(self, nbytes: int, align: int = 64) -> Region:
        """Reserve `nbytes` bytes at an `align`-aligned offset (owner only)."""
        return self._owned_allocator().alloc(nbytes, align)

    def free(self, region: Region) -> None:
        self._owned_allocator().free(region)

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
        """A zero-copy tensor of `dtype` and `shape` over the bytes at `offset`; writes go to the shared file."""
        shape = tuple(shape)
        itemsize = dtype.itemsize
        numel = 1
        for dim in shape:
            if dim < 0:
                raise ValueError(f"negative dimension in shape {shape}")
            numel *= dim
        if offset < 0 or offset + numel * itemsize > self.nbytes:
            raise ValueError(f"{numel * itemsize} bytes at offset {offset} exceed arena {self.name} ({self.nbytes})")
        if offset % itemsize:
            raise ValueError(f"offset {offset} is not aligned to {dtype} ({itemsize} bytes)")
        return self.data[offset : offset + numel * itemsize].view(dtype).view(shape)

    def pin_for_cuda(self) -> bool:
        """Page-lock the mapping (cudaHostRegister) so H2D copies from views run async at full speed.

        Returns False without CUDA. Untested here (no GPU). Views must not be in use by the GPU after `close()`.
        """
        if self._pinned_ptr is not None:
            return True
        if not torch.cuda.is_available():
            return False
        ptr = self.data.data_ptr()
        err = torch.cuda.cudart().cudaHostRegister(ptr, self.nbytes, _CUDA_HOST_REGISTER_PORTABLE)
        if int(err) != 0:
            raise ArenaError(f"cudaHostRegister of arena {self.name} failed with CUDA error {int(err)}")
        self._pinned_ptr = ptr
        return True

    def close(self) -> None:
        """Drop this process's mapping (freed once no view is left); the owner also unlinks the file."""
        if self._pinned_ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
            self._pinned_ptr = None
        self._finalizer()
        self._data = None

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.nbytes} bytes"
        return f"Arena({self.name!r}, {state}, {'owner' if self.owner else 'attached'})"

    def _owned_allocator(self) -> FirstFitAllocator:
        if self._allocator is None:
            raise RuntimeError(f"only the owner of arena {self.name} allocates in it")
        return self._allocator


def sweep_dead_arenas(tag: str | None = None, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove the arena files of job `tag` (None: of every job) whose owner pid is not alive; returns their paths.

    Only files this user owns, named in this process's pid namespace, are candidates (a pid read from another
    namespace says nothing about liveness here), and a file that cannot be removed is skipped: the sweep never
    raises. Liveness is `procs.pid_alive`: a pid reused by an unrelated process keeps its file (harmless), and an
    owner that is dead but not yet reaped (a zombie) counts as dead.
    """
    removed = []
    try:
        entries = sorted(os.listdir(shm_dir))
    except OSError:
        return removed
    uid, ns = os.geteuid(), pid_namespace()
    for filename in entries:
        name = ArenaName.parse(filename)
        if name is None or name.ns != ns or (tag is not None and name.tag != tag) or pid_alive(name.pid):
            continue
        path = Path(shm_dir) / filename
        try:
            st = os.lstat(path)
            if st.st_uid != uid or not stat.S_ISREG(st.st_mode):
                continue
            os.unlink(path)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        removed.append(path)
    return removed


_swept: set[tuple[int, str]] = set()  # (pid, tag) pairs whose sweep ran


def _sweep_once(tag: str) -> None:
    if (os.getpid(), tag) not in _swept:
        _swept.add((os.getpid(), tag))
        sweep_dead_arenas(tag)


def _create_file(prefix: str, tag: str) -> tuple[int, Path]:
    """Create a new arena file (0600, never through a symlink) under a fresh random name; returns (fd, path)."""
    for _ in range(_CREATE_ATTEMPTS):
        path = ArenaName(prefix, os.getpid(), tag).path
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), path
        except FileExistsError:
            continue
        except OSError as e:
            raise ArenaError(f"cannot create arena {path}: {e.strerror}") from None
    try:
        owner = f"uid {os.lstat(path).st_uid}"
    except OSError:
        owner = "an unknown user"
    raise ArenaError(
        f"arena name {path} is taken (owned by {owner}) after {_CREATE_ATTEMPTS} random names: "
        f"someone is filling {SHM_DIR} with names like ours"
    )


def _reserve(fd: int, nbytes: int, path: Path) -> None:
    """Allocate the file's pages now: a full /dev/shm fails here with a message, not later with SIGBUS."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ArenaError(
                f"not enough space in {SHM_DIR} for arena {path.name} ({nbytes} bytes); "
                "free some or enlarge it (docker run --shm-size)"
            ) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, nbytes)


def _unlink_if_owner(path: str | None, owner_pid: int) -> None:
    if path is not None and os.getpid() == owner_pid:  # a forked child inherits the finalizer, not the file
        Path(path).unlink(missing_ok=True)
