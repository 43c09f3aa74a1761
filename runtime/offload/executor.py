"""`OpExecutor`: runs scheduled ops with real overlap, one worker thread per resource.

Each resource ("io", "cpu", "device") has a worker that repeatedly takes the first op of its queue, in
priority (list) order, whose dependencies are done; so the device computes a draft step while the next ffn
still waits for its weights. Torch kernels and file reads release the GIL, so the workers truly overlap.

An exception in any op stops every worker and is re-raised (as `PipelineError`) by the next `wait` call:
nothing hangs on a dead dependency. Ops can be cancelled before they start (`cancel_from`), e.g. the
prefetched steps after the last token.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext

from specoffload.planner.errors import SpecOffloadError

from .schedule import RESOURCES, Op


class PipelineError(SpecOffloadError):
    """An op of the pipeline failed; the original exception is the __cause__."""


class OpExecutor:
    """Dataflow executor over `Op`s. handlers: op kind -> callable(op). tracer: optional span recorder."""

    def __init__(
        self,
        handlers: Mapping[str, Callable[[Op], None]],
        tracer=None,  # noqa: ANN001 - runtime.trace.Tracer or None
        resources: Sequence[str] = RESOURCES,
        on_thread_start: Callable[[str], None] | None = None,
    ) -> None:
        self.handlers = dict(handlers)
        self.tracer = tracer
        self._cond = threading.Condition()
        self._queues: dict[str, list[Op]] = {r: [] for r in resources}
        self._done: set[int] = set()  # done op ids >= _done_below (ids below it are all done: memory stays flat)
        self._done_below = 0
        self._running: set[int] = set()  # taken from a queue, not done yet
        self._error: BaseException | None = None
        self._failed = ""  # what failed, for the message: "op ffn(i=0, ...)" or "start of the io worker"
        self._closed = False
        self._on_thread_start = on_thread_start
        self._threads = [
            threading.Thread(target=self._work, args=(r,), name=f"specoffload-{r}", daemon=True) for r in resources
        ]
        for t in self._threads:
            t.start()

    # ---- submission and waiting ---------------------------------------------------------------
    def submit(self, ops: Sequence[Op]) -> None:
        with self._cond:
            self._raise_if_failed()
            for op in ops:  # all or nothing: a bad op rejects the whole batch
                if op.kind not in self.handlers:
                    raise ValueError(f"no handler for op kind {op.kind!r}")
                if op.resource not in self._queues:
                    raise ValueError(f"no worker for resource {op.resource!r} of {op}")
            for op in ops:
                self._queues[op.resource].append(op)
            self._cond.notify_all()

    def wait(self, op_ids: Sequence[int], timeout: float | None = None) -> None:
        """Block until every op in op_ids is done (or cancelled); re-raise a failure of any op."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._error is not None or all(self._is_done(i) for i in op_ids), timeout)
            self._raise_if_failed()
            if not ok:
                raise TimeoutError(f"ops {list(op_ids)} not done after {timeout} s")

    def wait_all(self, timeout: float | None = None) -> None:
        """Block until every submitted op is done or cancelled, including the ones running now."""
        with self._cond:
            pending = [op.id for q in self._queues.values() for op in q] + sorted(self._running)
        self.wait(pending, timeout)

    def cancel_from(self, step: int) -> int:
        """Drop queued ops of steps >= step that have not started; returns how many were dropped."""
        with self._cond:
            dropped = 0
            for q in self._queues.values():
                keep = []
                for op in q:
                    if op.step >= step:
                        self._mark_done(op.id)
                        dropped += 1
                    else:
                        keep.append(op)
                q[:] = keep
            self._cond.notify_all()
            return dropped

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    def __enter__(self) -> OpExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- workers ------------------------------------------------------------------------------
    def _is_done(self, op_id: int) -> bool:
        return op_id < self._done_below or op_id in self._done

    def _mark_done(self, op_id: int) -> None:
        """Note op_id done (under the lock); the ids below the lowest one not done leave the set."""
        self._done.add(op_id)
        while self._done_below in self._done:
            self._done.remove(self._done_below)
            self._done_below += 1

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise PipelineError(f"pipeline {self._failed} failed: {self._error}") from self._error

    def _fail(self, exc: BaseException, what: str) -> None:
        with self._cond:
            if self._error is None:
                self._error, self._failed = exc, what
            self._cond.notify_all()

    def _next_ready(self, resource: str) -> Op | None:
        for n, op in enumerate(self._queues[resource]):
            if all(self._is_done(d) for d in op.deps):
                self._running.add(op.id)
                return self._queues[resource].pop(n)
        return None

    def _work(self, resource: str) -> None:
        try:
            if self._on_thread_start is not None:
                self._on_thread_start(resource)
        except BaseException as exc:  # noqa: BLE001 - a dead worker would leave its ops waiting forever
            self._fail(exc, f"start of the {resource} worker")
            return
        while True:
            with self._cond:
                op = None
                while not self._closed and self._error is None:
                    op = self._next_ready(resource)
                    if op is not None:
                        break
                    self._cond.wait()
                if op is None:
                    return
            try:
                span = self.tracer.span(op.kind, resource, **_args(op)) if self.tracer else nullcontext()
                with span:
                    self.handlers[op.kind](op)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the waiting thread
                self._fail(exc, f"op {op}")
                return
            with self._cond:
                self._running.discard(op.id)
                self._mark_done(op.id)
                self._cond.notify_all()


def _args(op: Op) -> dict[str, int]:
    args = {"step": op.step}
    for name in ("layer", "batch", "token", "slot"):
        value = getattr(op, name)
        if value >= 0:
            args[name] = value
    if op.group > 0:  # an expert group past the first (as Op.__str__ shows it)
        args["group"] = op.group
    return args
