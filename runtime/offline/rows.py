"""The row types of a job: parsed from the input, failed, or ready for the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..sampling import SamplingParams

#: endpoints a row can ask for: the simple format's plain completion, and the two OpenAI Batch API urls
ENDPOINTS = ("simple", "completions", "chat")


@dataclass(frozen=True)
class RowRequest:
    """One input row, parsed and checked for shape (not yet tokenised).

    prompt: text or token ids (simple, completions); messages: the chat (chat). overrides: the row's own sampling
    fields, by SamplingParams name (max_new_tokens, temperature, top_p, top_k, seed, penalties, min_tokens, n,
    logprobs) plus `stop` (strings).
    """

    index: int
    lineno: int
    endpoint: str = "simple"
    prompt: str | tuple[int, ...] | None = None
    messages: tuple[dict[str, str], ...] | None = None
    custom_id: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    model: str | None = None  # what the row named (echoed in its response)
    return_token_ids: bool = False


@dataclass(frozen=True)
class RowError:
    """A row that cannot run; it becomes an error row in the output, in its place."""

    index: int
    lineno: int
    code: str  # invalid_json, invalid_request, unknown_url, invalid_parameter, empty_prompt, prompt_too_long, ...
    message: str
    custom_id: str | None = None


@dataclass(frozen=True)
class RowJob:
    """A row ready for the engine: its prompt's token ids and its own sampling parameters."""

    request: RowRequest
    token_ids: tuple[int, ...]
    params: SamplingParams
    sample: int = 0  # which of the row's params.n independent samples this engine request is

    @property
    def index(self) -> int:
        return self.request.index

    @property
    def key(self) -> int | str:
        """The random-stream key of this sample (runtime/rng.py `row_seed`): the row's index for sample 0 (so a row
        with n = 1 draws as it always did), "index:sample" for the others: independent, and the same on every run,
        chunking and resume point (as `LLM.generate` keys its samples)."""
        i = self.request.index
        return i if self.sample == 0 else f"{i}:{self.sample}"


@dataclass(frozen=True)
class RowResult:
    """What the engine made of a `RowJob` (the fields of GenerationResult that travel back)."""

    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: str
    num_drafted: int = 0
    num_accepted: int = 0
    stop_reason: int | str | None = None  # the stop string or stop id that ended the row (None: EOS or length)
    #: when params.logprobs is set: per token, (id, logprob, rank) of the chosen token then of the top-N
    logprobs: tuple[tuple[tuple[int, float, int], ...], ...] | None = None
    time_to_first_token_s: float | None = None  # from the row's admission to its first token
    time_s: float | None = None  # from the row's admission to its end

    @classmethod
    def of(cls, result: Any) -> RowResult:
        """From an engine's `GenerationResult`, or its fields as a mapping (what a replica sends back over Ray):
        the one place a result becomes a row's."""
        get = result.get if isinstance(result, dict) else (lambda name, default=None: getattr(result, name, default))
        return cls(tuple(get("token_ids")), get("text"), get("finish_reason"), get("num_drafted", 0),
                   get("num_accepted", 0), get("stop_reason"), frozen_logprobs(get("logprobs")),
                   get("time_to_first_token_s"), get("time_s"))


Row = RowJob | RowError


def frozen_logprobs(entries: Any) -> tuple[tuple[tuple[int, float, int], ...], ...] | None:
    """GenerationResult.logprobs (lists, or lists off the wire) as RowResult holds them: tuples."""
    if entries is None:
        return None
    return tuple(tuple((int(t), float(x), int(rank)) for t, x, rank in entry) for entry in entries)
