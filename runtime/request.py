"""Per-request decoding state and the result handed back to the caller."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")
V = TypeVar("V")

#: one generated token's log-probabilities: (token id, logprob, rank) for the chosen token first, then the top-N
TokenLogprobs = list[tuple[int, float, int]]


@dataclass(frozen=True)
class GenerationResult:
    """One prompt's completion.

    token_ids: new tokens only (a terminating EOS / stop token is included, as transformers does).
    finish_reason: "stop" (EOS or a stop id) or "length" (max_new_tokens or the model's context).
    num_drafted / num_accepted: draft tokens proposed for this row and accepted by the target.
    stop_reason: the stop string or stop id (from SamplingParams.stop / stop_token_ids) that ended it; None for EOS
    or the length limit. logprobs: per token, (id, logprob, rank) of the chosen token then of the top-N (None when
    not asked for); cumulative_logprob: the chosen tokens' sum. time_to_first_token_s / time_s: from the row's
    admission (its prompt read) to its first token / to its end.
    """

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    num_drafted: int
    num_accepted: int
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    time_to_first_token_s: float | None = None
    time_s: float | None = None

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0


@dataclass
class Request:
    """A prompt being decoded. `tokens` holds prompt + output (the committed sequence).

    seed: the row's own random stream (runtime/rng.py `row_seed` of the job seed and the row's key); None: it draws
    nothing (a greedy row in a greedy run). warp: its (temperature, top_p, top_k); rows of different warpings run
    in one batch (runtime/sampling.py `warp_rows`).

    Logit processing (runtime/logits_process.py, applied to the target's logits before verification): penalties
    (presence, frequency, repetition), min_tokens (masks `min_stop_ids` until that many tokens are out) and
    logprobs (top-N recorded per committed token). stop_strings end the row once `decode`d output holds one
    (`stop_reason`: the string; a user stop id in `user_stop_ids` is its own stop_reason; EOS: None)."""

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
    penalties: tuple[float, float, float] = (0.0, 0.0, 1.0)  # (presence, frequency, repetition)
    min_tokens: int = 0
    logprobs: int | None = None
    user_stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    include_stop_str: bool = False
    decode: Callable[[list[int]], str] | None = field(default=None, repr=False, compare=False)
    stop_reason: int | str | None = None
    token_logprobs: list[TokenLogprobs] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None

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

    @property
    def processed(self) -> bool:
        """Whether the target's logits for this row need processing (runtime/logits_process.py)."""
        return (self.penalties != (0.0, 0.0, 1.0) or self.logprobs is not None
                or (self.min_tokens > len(self.output) and bool(self.min_stop_ids)))

    @property
    def min_stop_ids(self) -> frozenset[int]:
        """The ids min_tokens masks: every id that would end the row."""
        return self.stop_ids

    def commit(self, new_tokens: list[int]) -> None:
        """Append verified tokens, stopping at the first stop id, stop string or at the length limit."""
        if new_tokens and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        for token in new_tokens:
            self.output.append(token)
            if len(self.output) < self.min_tokens:  # (min_tokens masks the stop ids' logits before this too)
                pass
            elif token in self.stop_ids:
                self.finish_reason = "stop"
                self.stop_reason = token if token in self.user_stop_ids else None
                break
            elif self.stop_strings and self._stop_string() is not None:
                self.finish_reason = "stop"
                break
            if self.remaining <= 0:
                self.finish_reason = "length"
                break
        if self.finish_reason is not None:
            self.finished_at = time.monotonic()

    def _stop_string(self) -> str | None:
        """The stop string the output's tail now holds, if any (looked for in the text of the last tokens only:
        each token is at least one character, so the longest string's length in tokens holds any new match; two
        more, as a tokenizer may drop the first token's leading space)."""
        assert self.decode is not None
        tail = self.decode(self.output[-(max(len(s) for s in self.stop_strings) + 2):])
        for s in self.stop_strings:
            if s in tail:
                self.stop_reason = s
                return s
        return None


class Feed(Generic[T]):
    """An open-ended, thread-safe source of requests (or of anything a stream reads): producers `put` items and
    finally `close` it; a stream takes what is there *now* (`take`, never blocking) and idles on `wait` while it is
    open and empty. A replica's long-lived engine stream reads a job's leased chunks from one (actors/coordinator.py).
    `map(f)` is a view whose items are f(item), taken lazily in order (an engine encodes prompts that way)."""

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._closed = False
        self._cond = threading.Condition()

    def put(self, items: Iterable[T]) -> None:
        with self._cond:
            if self._closed:
                raise ValueError("put on a closed Feed")
            self._items.extend(items)
            self._cond.notify_all()

    def close(self) -> None:
        """No more items: a stream over it ends once it has taken and finished every one."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def exhausted(self) -> bool:
        """Closed and empty: nothing will ever come."""
        with self._cond:
            return self._closed and not self._items

    def take(self, n: int) -> list[T]:
        """Up to n items, those there now (never blocks)."""
        with self._cond:
            return [self._items.popleft() for _ in range(min(n, len(self._items)))]

    def wait(self, timeout: float) -> bool:
        """Block until an item is there or the feed is closed (or `timeout` s pass); whether one of those holds."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._items) or self._closed, timeout)

    def map(self, f: Callable[[T], U]) -> MappedFeed[U]:
        return MappedFeed(self, f)


class MappedFeed(Generic[U]):
    """A `Feed` seen through f: the same items, each f(item) as it is taken (in order)."""

    def __init__(self, feed: Feed[Any] | MappedFeed[Any], f: Callable[[Any], U]) -> None:
        self._feed, self._f = feed, f

    @property
    def closed(self) -> bool:
        return self._feed.closed

    @property
    def exhausted(self) -> bool:
        return self._feed.exhausted

    def take(self, n: int) -> list[U]:
        return [self._f(x) for x in self._feed.take(n)]

    def wait(self, timeout: float) -> bool:
        return self._feed.wait(timeout)

    def map(self, f: Callable[[U], V]) -> MappedFeed[V]:
        return MappedFeed(self, f)


class Waiting:
    """The requests not yet admitted: a buffer in front of a (possibly lazy) iterator of them, pulled only as slots
    free up, so a job's rows stream through one pipeline. Thread-safe (the verify op and the schedule loop ask).

    Over a `Feed` (`streaming`), pulls never block: `available` counts what has arrived, and `ended` holds only
    once the feed is closed and drained; a runner idles on `wait` meanwhile. Over an iterator, a pull blocks on
    `next` and `ended` holds once it is exhausted."""

    def __init__(self, source: Iterable[Request] | Feed[Request] | MappedFeed[Request]) -> None:
        self.streaming = isinstance(source, (Feed, MappedFeed))
        self._feed = source if isinstance(source, (Feed, MappedFeed)) else None
        self._source = None if self._feed is not None else iter(source)  # type: ignore[arg-type]
        self._buffer: deque[Request] = deque()
        self._exhausted = False
        self._lock = threading.Lock()

    def available(self, n: int) -> int:
        """Pull from the source until n requests are buffered (or it ends; over a feed: what is there now); how
        many are."""
        with self._lock:
            if self._feed is not None:
                if len(self._buffer) < n:
                    self._buffer.extend(self._feed.take(n - len(self._buffer)))
                return len(self._buffer)
            while len(self._buffer) < n and not self._exhausted:
                try:
                    assert self._source is not None
                    self._buffer.append(next(self._source))
                except StopIteration:
                    self._exhausted = True
            return len(self._buffer)

    def popleft(self) -> Request:
        self.available(1)
        with self._lock:
            return self._buffer.popleft()

    def peek(self, n: int) -> list[Request]:
        """The first n waiting requests (fewer if fewer are there), without taking them."""
        self.available(n)
        with self._lock:
            return list(self._buffer)[:n]

    @property
    def buffered(self) -> int:
        """Requests pulled from the source and waiting here (a lazy source's rest is not counted)."""
        with self._lock:
            return len(self._buffer)

    def push_front(self, request: Request) -> None:
        """Put a request back at the head of the queue (a preempted row: it is the next one admitted)."""
        with self._lock:
            self._buffer.appendleft(request)

    def __bool__(self) -> bool:
        return self.available(1) > 0

    @property
    def ended(self) -> bool:
        """No request is waiting and none ever will (an exhausted iterator; a closed, drained feed)."""
        if self.available(1):
            return False
        return self._feed.exhausted if self._feed is not None else True

    def wait(self, timeout: float) -> None:
        """Idle until a request arrives or the source ends (a feed), at most `timeout` s; an iterator never idles."""
        if self._feed is not None and not self._buffer:
            self._feed.wait(timeout)
