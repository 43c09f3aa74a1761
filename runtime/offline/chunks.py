"""Chunks: the unit a backend runs, a worker leases, and the output appends.

Chunk c holds the rows with index // chunk_size == c, in input order, error rows included (they are written in
their place but never run). Chunk numbers are contiguous from the first unfinished chunk. A backend yields
`ChunkDone`s in any order; `InOrder` releases them in chunk order for the output. `LeaseBook` is the bookkeeping
of a backend with several workers: which chunk is leased to which worker, lost leases back to the front of the
queue, each chunk completed once, and a window that bounds how far ahead of the oldest unfinished chunk work is
handed out (so the chunks waiting in `InOrder` stay few, and memory stays flat however long the input is).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

from .rows import Row, RowError, RowJob, RowResult


@dataclass(frozen=True)
class Chunk:
    number: int
    rows: tuple[Row, ...]  # input order; RowErrors keep their place

    @property
    def jobs(self) -> tuple[RowJob, ...]:
        """The engine requests of the chunk, in input order: one per sample of each runnable row (a row with
        params.n = 2 is two requests, sample 0 then 1; the writer gathers them back into the row's one line)."""
        return tuple(r if s == 0 else dataclasses.replace(r, sample=s)
                     for r in self.rows if isinstance(r, RowJob) for s in range(r.params.n))

    def payload(self) -> tuple[list[list[int]], list[dict[str, Any]], list[int | str]]:
        """What a remote worker needs: the prompts' token ids, each request's SamplingParams fields, and each
        request's key for its random stream (the row's index in the input, with the sample: RowJob.key)."""
        jobs = self.jobs
        return ([list(j.token_ids) for j in jobs], [dataclasses.asdict(j.params) for j in jobs],
                [j.key for j in jobs])


@dataclass(frozen=True)
class ChunkDone:
    """A chunk's results, one per job in order, and the worker that ran it."""

    chunk: Chunk
    results: tuple[RowResult, ...]
    worker: str = "local"

    @property
    def number(self) -> int:
        return self.chunk.number


def chunked(rows: Iterator[Row], size: int) -> Iterator[Chunk]:
    """Group rows (ascending index) into chunks of the indices index // size."""
    number, group = None, []
    for row in rows:
        c = row.index // size
        if group and c != number:
            yield Chunk(number, tuple(group))
            group = []
        number = c
        group.append(row)
    if group:
        yield Chunk(number, tuple(group))


def errors_only(chunk: Chunk) -> ChunkDone | None:
    """The result of a chunk with nothing to run (every row failed), else None."""
    return ChunkDone(chunk, ()) if all(isinstance(r, RowError) for r in chunk.rows) else None


class InOrder:
    """Releases done chunks in chunk order, starting at `first`."""

    def __init__(self, first: int = 0) -> None:
        self.next = first
        self.waiting: dict[int, ChunkDone] = {}

    def add(self, done: ChunkDone) -> list[ChunkDone]:
        if done.number >= self.next:
            self.waiting.setdefault(done.number, done)  # a second result for a chunk is dropped
        ready = []
        while self.next in self.waiting:
            ready.append(self.waiting.pop(self.next))
            self.next += 1
        return ready


class LeaseBook:
    """Chunks from `source` leased to workers. `next()` gives a lost chunk first (lowest number), else a new one while
    it is fewer than `window` chunks ahead of the oldest unfinished one; `complete` is true once per chunk."""

    def __init__(self, source: Iterator[Chunk], window: int) -> None:
        self.source, self.window = source, max(window, 1)
        self.queue: list[tuple[int, Chunk]] = []  # heap of lost chunks
        self.leases: dict[int, tuple[Chunk, Hashable]] = {}
        self.finished: set[int] = set()  # completed numbers at or above `low`
        self.low: int | None = None  # every chunk below it is complete
        self.pulled: int | None = None  # the last number taken from the source
        self.exhausted = False
        self.lost = 0

    def next(self) -> Chunk | None:
        if self.queue:
            return heapq.heappop(self.queue)[1]
        if self.exhausted or (self.pulled is not None and self.pulled + 1 - self._oldest() >= self.window):
            return None
        chunk = next(self.source, None)
        if chunk is None:
            self.exhausted = True
            return None
        if self.low is None:
            self.low = chunk.number
        self.pulled = chunk.number
        return chunk

    def _oldest(self) -> int:
        """The lowest chunk number not complete (pulled or not)."""
        assert self.low is not None
        return self.low

    def lease(self, chunk: Chunk, worker: Hashable) -> None:
        self.leases[chunk.number] = (chunk, worker)

    def complete(self, number: int) -> bool:
        """Record chunk `number` done; False if it already was (a late result of a lost lease)."""
        self.leases.pop(number, None)
        if self.low is None or number < self.low or number in self.finished:
            return False
        self.queue = [(n, c) for n, c in self.queue if n != number]
        heapq.heapify(self.queue)
        self.finished.add(number)
        while self.low in self.finished:
            self.finished.discard(self.low)
            self.low += 1
        return True

    def lose(self, number: int) -> Chunk | None:
        """A lease ended without a result: its chunk goes back to the front of the queue."""
        entry = self.leases.pop(number, None)
        if entry is None:
            return None
        self.lost += 1
        heapq.heappush(self.queue, (number, entry[0]))
        return entry[0]

    def worker_of(self, number: int) -> Hashable | None:
        entry = self.leases.get(number)
        return entry[1] if entry else None

    @property
    def done(self) -> bool:
        return self.exhausted and not self.queue and not self.leases
