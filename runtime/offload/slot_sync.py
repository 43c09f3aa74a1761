"""`SlotSync`: the ordering protocol between the loader's copies into a ring slot and the compute that reads it.

On CUDA a load only *queues* its host->device copies on the loader's copy stream, and a layer only *queues* its
kernels on the compute stream, so the executor's op order (load before ffn, ffn before the next load into the
same slot; schedule.py) is not enough: two events per slot carry it onto the streams.

    load into slot s      copy stream waits  released[s]   (the last reader's kernels have run)
                          ... copies ...
                          copy stream records loaded[s]
    read slot s           compute stream waits loaded[s]   (the copies have landed)
                          ... kernels ...
                          compute stream records released[s]

`CudaSlotSync` does exactly that with `torch.cuda.Event`s. On the CPU every copy and kernel runs synchronously in
the thread that issues it and the executor's dependencies order them, so `SlotSync` (the base) does nothing.
`RecordingSlotSync` wraps another sync and logs every call with the slot's load generation; `check_protocol`
verifies a log: no read of a slot before a wait on the load it reads, and no load into a slot before a wait on the
release that followed its previous readers. The CPU tests run the real pipeline with it (tests/test_slot_sync.py),
so the calls a CUDA run makes are checked on a machine without a GPU.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch


class SlotSync:
    """The protocol's four calls; on the CPU they are no-ops (see the module docstring)."""

    def before_load(self, slot: int, stream: Any = None) -> None:
        """The loader is about to overwrite `slot` on `stream` (its copy stream on CUDA)."""

    def after_load(self, slot: int, stream: Any = None) -> None:
        """Every copy into `slot` is queued on `stream`."""

    def before_use(self, slot: int) -> None:
        """The current thread's stream is about to read `slot`."""

    def after_use(self, slot: int) -> None:
        """Every read of `slot` is queued on the current thread's stream."""


class CudaSlotSync(SlotSync):
    """Events on the copy and compute streams of one CUDA device (module docstring)."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.device = device
        self.loaded: list[torch.cuda.Event | None] = [None] * num_slots
        self.released: list[torch.cuda.Event | None] = [None] * num_slots

    def before_load(self, slot: int, stream: Any = None) -> None:
        event = self.released[slot]
        if event is not None:
            (stream or torch.cuda.current_stream(self.device)).wait_event(event)

    def after_load(self, slot: int, stream: Any = None) -> None:
        self.loaded[slot] = (stream or torch.cuda.current_stream(self.device)).record_event()

    def before_use(self, slot: int) -> None:
        event = self.loaded[slot]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def after_use(self, slot: int) -> None:
        self.released[slot] = torch.cuda.current_stream(self.device).record_event()


def slot_sync(num_slots: int, device: torch.device) -> SlotSync:
    """The sync for slots on `device`: events on CUDA, nothing on the CPU."""
    return CudaSlotSync(num_slots, device) if device.type == "cuda" else SlotSync()


@dataclass(frozen=True)
class SyncEvent:
    """One call of the protocol: `call` on `slot` by thread `thread`; `generation` counts the loads of the slot
    begun so far (the load a read sees is generation g: the g-th load)."""

    call: str  # "before_load" | "after_load" | "before_use" | "after_use"
    slot: int
    generation: int
    thread: str


class RecordingSlotSync(SlotSync):
    """Logs every call (in call order, across threads) and forwards it to `inner`."""

    def __init__(self, inner: SlotSync | None = None) -> None:
        self.inner = inner or SlotSync()
        self.log: list[SyncEvent] = []
        self._generation: dict[int, int] = {}
        self._lock = threading.Lock()

    def _record(self, call: str, slot: int) -> None:
        with self._lock:
            if call == "before_load":
                self._generation[slot] = self._generation.get(slot, 0) + 1
            self.log.append(SyncEvent(call, slot, self._generation.get(slot, 0), threading.current_thread().name))

    def before_load(self, slot: int, stream: Any = None) -> None:
        self._record("before_load", slot)
        self.inner.before_load(slot, stream)

    def after_load(self, slot: int, stream: Any = None) -> None:
        self.inner.after_load(slot, stream)
        self._record("after_load", slot)

    def before_use(self, slot: int) -> None:
        self._record("before_use", slot)
        self.inner.before_use(slot)

    def after_use(self, slot: int) -> None:
        self.inner.after_use(slot)
        self._record("after_use", slot)


def check_protocol(log: list[SyncEvent]) -> list[str]:
    """The violations of the slot protocol in `log` (empty: none). Per slot, in log order:
    - a load (before_load .. after_load) never overlaps a read (before_use .. after_use) or another load;
    - a read happens only after a completed load (its before_use follows that load's after_load), so the stream
      waits on the event of the very load whose data it reads;
    - a load after readers begins only after every one of them has released the slot (after_use), so the copy
      stream waits on the last reader's release event;
    - at the end, no load is in flight and every read has released its slot.
    """
    problems: list[str] = []
    loading: dict[int, bool] = {}
    loaded: dict[int, int] = {}  # slot -> generation of the last completed load
    readers: dict[int, int] = {}  # slot -> reads begun and not released
    for n, e in enumerate(log):
        where = f"event {n} ({e.call} slot {e.slot} gen {e.generation} on {e.thread})"
        if e.call == "before_load":
            if loading.get(e.slot):
                problems.append(f"{where}: a load begins while another load of the slot is in flight")
            if readers.get(e.slot, 0):
                problems.append(f"{where}: the slot is overwritten while {readers[e.slot]} reader(s) hold it")
            loading[e.slot] = True
        elif e.call == "after_load":
            if not loading.get(e.slot):
                problems.append(f"{where}: a load completes that never began")
            loading[e.slot] = False
            loaded[e.slot] = e.generation
        elif e.call == "before_use":
            if loading.get(e.slot):
                problems.append(f"{where}: the slot is read while a load into it is in flight")
            elif e.slot not in loaded:
                problems.append(f"{where}: the slot is read before any load into it")
            readers[e.slot] = readers.get(e.slot, 0) + 1
        elif e.call == "after_use":
            if not readers.get(e.slot):
                problems.append(f"{where}: a release without a read")
            else:
                readers[e.slot] -= 1
        else:
            problems.append(f"{where}: unknown call")
    problems += [f"slot {slot}: a load never completed" for slot, busy in sorted(loading.items()) if busy]
    problems += [f"slot {slot}: {n} read(s) never released" for slot, n in sorted(readers.items()) if n]
    return problems
