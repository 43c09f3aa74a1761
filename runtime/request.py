"""Per-request decoding state and the result handed back to the caller."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GenerationResult:
    """One prompt's completion.

    token_ids: new tokens only (a terminating EOS / stop token is included, as transformers does).
    finish_reason: "stop" (EOS or a stop id) or "length" (max_new_tokens or the model's context).
    num_drafted / num_accepted: draft tokens proposed for this row and accepted by the target.
    """

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    num_drafted: int
    num_accepted: int

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0


@dataclass
class Request:
    """A prompt being decoded. `tokens` holds prompt + output (the committed sequence).

    seed: the row's own random stream (runtime/rng.py `row_seed` of the job seed and the row's key); None: it draws
    nothing (a greedy row in a greedy run). warp: its (temperature, top_p, top_k); rows of different warpings run
    in one batch (runtime/sampling.py `warp_rows`)."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    seed: int | None = None
    warp: tuple[float, float, int] = (0.0, 1.0, 0)
    output: list[int] = field(default_factory=list)
    num_drafted: int = 0
    num_accepted: int = 0
    finish_reason: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output)

    @property
    def greedy(self) -> bool:
        return self.warp[0] == 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def commit(self, new_tokens: list[int]) -> None:
        """Append verified tokens, stopping at the first stop id or at the length limit."""
        for token in new_tokens:
            self.output.append(token)
            if token in self.stop_ids:
                self.finish_reason = "stop"
                return
            if self.remaining <= 0:
                self.finish_reason = "length"
                return


class Waiting:
    """The requests not yet admitted: a buffer in front of a (possibly lazy) iterator of them, pulled only as slots
    free up, so a job's rows stream through one pipeline. Thread-safe (the verify op and the schedule loop ask)."""

    def __init__(self, source: Iterable[Request]) -> None:
        self._source = iter(source)
        self._buffer: deque[Request] = deque()
        self._exhausted = False
        self._lock = threading.Lock()

    def available(self, n: int) -> int:
        """Pull from the source until n requests are buffered (or it ends); how many are."""
        with self._lock:
            while len(self._buffer) < n and not self._exhausted:
                try:
                    self._buffer.append(next(self._source))
                except StopIteration:
                    self._exhausted = True
            return len(self._buffer)

    def popleft(self) -> Request:
        self.available(1)
        with self._lock:
            return self._buffer.popleft()

    def __bool__(self) -> bool:
        return self.available(1) > 0
