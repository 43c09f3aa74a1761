"""What a user watches while a job runs, and the summary it ends with.

On a terminal: a tqdm bar over rows with tokens/s, acceptance and failed rows. Elsewhere (a Ray job's log, a file):
one line every `interval` seconds, from a timer thread, however long a chunk takes: rows done of total, tokens/s,
acceptance, ETA. Rates and the ETA count from `generating()` (the models loaded), not from the start: loading is
reported apart (`load_s`). The ETA is the rows left at the rows-per-second so far; before any row is written, the
tokens left if every row ran to `max_tokens` at the tokens-per-second so far (an upper bound: "at most").
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from tqdm import tqdm


@dataclass
class Tally:
    """Totals of one job (or of one worker)."""

    rows: int = 0
    failed: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    chunks: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class Progress:
    total: int  # rows of the whole input
    done_before: int = 0  # rows kept from a resumed output
    enabled: bool = True
    interval: float = 10.0
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    max_tokens: int | None = None  # new tokens a row runs to at most (the ETA before the first row is written)

    def __post_init__(self) -> None:
        self.tally = Tally()
        self.created = self.start = self.last = time.monotonic()
        self.load_s: float | None = None
        self.live: Callable[[], int] | None = None  # tokens committed so far, rows in flight included (backend)
        tty = self.enabled and self.stream.isatty()
        self.bar = tqdm(total=self.total, initial=self.done_before, unit="row", desc="generate", file=self.stream,
                        disable=not tty, dynamic_ncols=True)
        self.lines = self.enabled and not tty
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if self.lines and self.interval > 0:
            self._ticker = threading.Thread(target=self._tick, name="progress", daemon=True)
            self._ticker.start()

    def generating(self, live: Callable[[], int] | None = None) -> None:
        """The models are loaded: rates count from now; the time until now is the load time. live: the backend's
        tokens committed so far (rows in flight included), so the rate moves before a chunk is written."""
        with self._lock:
            self.live = live
            self.start = self.last = time.monotonic()
            self.load_s = self.start - self.created
        if self.lines:
            self._print(f"progress: models loaded in {self.load_s:.1f} s; generating")

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:  # before generation starts, the phase (not a rate of 0 tokens/s)
                line = self.line() if self.load_s is not None else \
                    f"loading models ({time.monotonic() - self.created:.0f} s)"
            self._print(f"progress: {line}")

    def _print(self, text: str) -> None:
        with contextlib.suppress(ValueError, OSError):  # a stream closed under the timer thread: nothing to say
            print(text, file=self.stream, flush=True)

    def update(self, rows: int, failed: int, tokens: int, drafted: int, accepted: int) -> None:
        with self._lock:
            self._update(rows, failed, tokens, drafted, accepted)

    def _update(self, rows: int, failed: int, tokens: int, drafted: int, accepted: int) -> None:
        t = self.tally
        t.rows, t.failed, t.tokens = t.rows + rows, t.failed + failed, t.tokens + tokens
        t.drafted, t.accepted, t.chunks = t.drafted + drafted, t.accepted + accepted, t.chunks + 1
        self.bar.update(rows)
        self.bar.set_postfix_str(self._postfix(), refresh=False)
        if self.lines and self._ticker is None:  # interval 0: a line per update (the timer thread does the rest)
            self._print(f"progress: {self.line()}")

    def rate(self) -> float:
        """Tokens per second since generation started: committed by the engine so far when the backend says
        (`live`), else those of the rows written."""
        tokens = self.tally.tokens
        if self.live is not None:
            tokens = max(tokens, self.live())
        return tokens / max(time.monotonic() - self.start, 1e-9)

    def _postfix(self) -> str:
        t = self.tally
        text = f"{self.rate():.1f} tok/s"
        if t.drafted:
            text += f", acceptance {t.acceptance:.2f}"
        return text + (f", {t.failed} failed" if t.failed else "")

    def line(self) -> str:
        t = self.tally
        done = self.done_before + t.rows
        elapsed = time.monotonic() - self.start
        if t.rows:
            eta = f"ETA {_duration((self.total - done) * elapsed / t.rows)}"
        else:
            rate = self.rate()
            live = self.live() if self.live is not None else 0
            left = (self.total - done) * self.max_tokens - live if self.max_tokens else None
            eta = (f"ETA at most {_duration(max(0, left) / rate)} (rows at max tokens)" if left is not None and rate > 0
                   else "ETA ?")
        return f"{done}/{self.total} rows ({100 * done / max(self.total, 1):.1f}%), {self._postfix()}, {eta}"

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join()
        self.bar.close()


def _duration(seconds: float) -> str:
    if seconds != seconds:  # NaN: nothing measured yet
        return "?"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
