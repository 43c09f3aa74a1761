"""One caller at a time: `Engine` and `LLM` hold one pipeline (its batches, KV caches and drafter state), so two
calls must never interleave. A `Turn` serialises them: a call from another thread waits until the running one
is done; a call from the thread that holds the turn (an open `generate_iter` / `stream` it has not exhausted or
closed) raises `EngineBusyError` at once, since waiting there would wait forever.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from specoffload.planner.errors import SpecOffloadError


class EngineBusyError(SpecOffloadError, RuntimeError):
    """A call on an engine whose previous call, on the same thread, is still open."""


class Turn:
    """A lock that knows its holder (see the module docstring). `with turn("generate"): ...`."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._lock = threading.Lock()
        self._holder: int | None = None
        self._holding = ""

    @contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        me = threading.get_ident()
        if self._holder == me:
            raise EngineBusyError(
                f"{self.owner}.{what}: this thread's {self.owner}.{self._holding} is still open (an iterator not yet "
                "exhausted): exhaust or close() it first; one call at a time per engine")
        with self._lock:  # another thread's call: wait for it
            self._holder, self._holding = me, what
            try:
                yield
            finally:
                self._holder = None
