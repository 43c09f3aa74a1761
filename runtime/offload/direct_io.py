"""Page-aligned host buffers and `DirectReader`: reads byte ranges of files with O_DIRECT, bypassing the page cache.

Streaming weights through the page cache would double their host-memory footprint (the cache keeps what we
already copied to the device) and let the kernel evict what we keep resident. O_DIRECT needs the file offset, the
length and the destination address aligned to the device's logical block size; we align everything to `ALIGN`
(4096, the page size, a multiple of every common block size) and return the requested slice of the aligned read.
Filesystems that refuse O_DIRECT (tmpfs, some FUSE and network mounts: EINVAL at open or at the first read) get
buffered reads followed by `posix_fadvise(DONTNEED)`, which drops the pages we just read from the cache.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from pathlib import Path

import torch

from ..models.errors import CheckpointError

ALIGN = 4096  # bytes: file offsets, read lengths and buffer addresses of O_DIRECT reads are multiples of this
DIRECT = "direct"
BUFFERED = "buffered+fadvise"


def align_down(n: int, align: int = ALIGN) -> int:
    return n // align * align


def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


class AlignedBuffer:
    """`nbytes` (rounded up to ALIGN) of host memory whose first byte is ALIGN-aligned, usable by O_DIRECT reads.

    Unpinned: an anonymous mmap (page aligned by construction). Pinned (`pin=True` and CUDA available, so
    host->device copies can be asynchronous): a pinned torch tensor over-allocated by ALIGN bytes and sliced at the
    first aligned address, since the pinned allocator does not promise page alignment.
    `.tensor` is a uint8 torch view of the memory, `.memoryview` a writable memoryview of the same bytes.
    """

    def __init__(self, nbytes: int, pin: bool = False) -> None:
        if nbytes <= 0:
            raise ValueError(f"buffer size must be positive, got {nbytes}")
        self.nbytes = align_up(nbytes)
        self.pinned = pin and torch.cuda.is_available()
        if self.pinned:
            raw = torch.empty(self.nbytes + ALIGN, dtype=torch.uint8, pin_memory=True)
            skip = -raw.data_ptr() % ALIGN
            self.tensor = raw[skip : skip + self.nbytes]
            self.memoryview = memoryview(self.tensor.numpy())
        else:
            self._mmap = mmap.mmap(-1, self.nbytes)
            self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
            self.memoryview = memoryview(self._mmap)
        assert self.tensor.data_ptr() % ALIGN == 0


class DirectReader:
    """Reads byte ranges of files into `AlignedBuffer`s, with O_DIRECT where the filesystem allows it.

    `mode` is "direct" until a file refuses O_DIRECT, then "buffered+fadvise" for this reader's remaining life
    (a checkpoint lives on one filesystem). File descriptors stay open per path until `close()`. Counters for
    reporting: `bytes_read` (bytes transferred, alignment padding included) and `reads` (`read_into` calls).
    Not thread-safe: use one reader per thread. A read is issued as `preadv` calls of at most `max_chunk` bytes
    (on the development VM, cold O_DIRECT reads of 1 to 64 MiB requests all ran at 0.6-1.7 GB/s, the spread being
    the load of the shared machine rather than the request size).
    """

    def __init__(self, direct: bool = True, max_chunk: int = 64 << 20) -> None:
        if max_chunk < ALIGN:
            raise ValueError(f"max_chunk must be at least {ALIGN} bytes, got {max_chunk}")
        self.mode = DIRECT if direct and hasattr(os, "O_DIRECT") else BUFFERED
        self.max_chunk = align_down(max_chunk)
        self.bytes_read = 0
        self.reads = 0
        self._fds: dict[str, int] = {}

    def read_into(self, path: str, offset: int, length: int, buf: AlignedBuffer, buf_offset: int = 0) -> torch.Tensor:
        """Read `length` bytes at byte `offset` of `path` into `buf`; return them as a uint8 view of `buf`.

        The aligned range covering [offset, offset + length) is read to `buf[buf_offset:]`, so the buffer needs
        room for `length` plus up to 2 * ALIGN bytes of padding. Raises CheckpointError if the file is missing,
        unreadable, or shorter than the range (it changed after its header was read).
        """
        if buf_offset % ALIGN:
            raise ValueError(f"buf_offset must be a multiple of {ALIGN}, got {buf_offset}")
        if offset < 0 or length < 0:
            raise ValueError(f"cannot read {length} bytes at offset {offset} of {path}")
        start = align_down(offset)
        span = align_up(offset + length) - start
        if buf_offset + span > buf.nbytes:
            raise ValueError(
                f"reading {length} bytes at offset {offset} needs {span} aligned bytes, but the buffer has "
                f"{buf.nbytes - buf_offset} from offset {buf_offset}"
            )
        needed = offset + length - start
        done = self._read_span(path, start, span, needed, buf.memoryview[buf_offset : buf_offset + span])
        if done < needed:
            available = max(0, done - (offset - start))
            raise CheckpointError(
                f"{path} is shorter than its header says: expected {length} bytes at offset {offset}, but only "
                f"{available} are available (the file was truncated or replaced after it was opened); "
                "restore or re-download the checkpoint and restart"
            )
        self.reads += 1
        head = buf_offset + offset - start
        return buf.tensor[head : head + length]

    def close(self) -> None:
        """Close every open file descriptor. The reader can still be used: files are reopened on demand."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> DirectReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals -------------------------------------------------------------------------------------

    def _read_span(self, path: str, start: int, span: int, needed: int, view: memoryview) -> int:
        """Read up to `span` bytes at `start` into `view` in chunks; return how many arrived (>= needed unless EOF)."""
        done = 0
        while done < needed:
            n = min(self.max_chunk, span - done)
            try:
                got = os.preadv(self._fd(path), [view[done : done + n]], start + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and self.mode == DIRECT:  # opened, but reads refused: fall back
                    self._fall_back()
                    continue
                raise CheckpointError(f"cannot read {path} at offset {start + done}: {exc}") from exc
            self.bytes_read += got
            done += got
            if got < n:  # end of file
                break
        if self.mode == BUFFERED:
            os.posix_fadvise(self._fd(path), start, span, os.POSIX_FADV_DONTNEED)
        return done

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = self._open(path)
        return fd

    def _open(self, path: str) -> int:
        try:
            if self.mode == DIRECT:
                try:
                    return os.open(path, os.O_RDONLY | os.O_DIRECT)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._fall_back()
            return os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(
                f"cannot open checkpoint file {path}: {exc.strerror}; restore or re-download the checkpoint"
            ) from exc

    def _fall_back(self) -> None:
        """Switch to buffered reads: reopen files on demand without O_DIRECT."""
        self.close()
        self.mode = BUFFERED


def drop_page_cache() -> None:
    """Flush dirty pages, then drop the whole page cache (needs root; silently skipped without it).

    The profiler and the benchmarks call it before timing a read so that a warm cache cannot flatter it. Our
    streamed reads use O_DIRECT and are cold either way; a baseline reading through the page cache also needs a
    per-file eviction (posix_fadvise, see scripts/hf_disk_offload.py), which works without root.
    """
    os.sync()
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
