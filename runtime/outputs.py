"""vLLM-shaped results of `LLM` (runtime/llm.py): RequestOutput holding one CompletionOutput per sample.

The fields and their meanings follow vLLM's `vllm.outputs` (request_id, prompt, prompt_token_ids, outputs[i].text,
.token_ids, .cumulative_logprob, .logprobs, .finish_reason, .stop_reason), so code written against vLLM's offline
`LLM.generate` reads these unchanged; `metrics` adds what speculation did for the request.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability under the target (after penalties, before temperature), its rank (1: the most
    likely), and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class CompletionOutput:
    """One sample of a request.

    token_ids: the new tokens (a terminating EOS / stop id included, as vLLM keeps it); text: their text, cut before
    a stop string unless include_stop_str_in_output. finish_reason: "stop" or "length"; stop_reason: the stop
    string or stop id that ended it (None: EOS or the length limit). logprobs (when asked for): per token, the
    chosen token's and the top-N tokens' Logprob by id; cumulative_logprob: the chosen tokens' sum.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_drafted: int = 0
    num_accepted: int = 0

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestMetrics:
    """Per-request timings (seconds, from when the request's prompt was admitted) and speculation counts, summed
    over its samples; time_to_first_token is the first sample's."""

    time_to_first_token: float | None
    time: float | None
    num_prompt_tokens: int
    num_generated_tokens: int
    num_drafted_tokens: int
    num_accepted_tokens: int

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_drafted_tokens if self.num_drafted_tokens else 0.0


@dataclass(frozen=True)
class RequestOutput:
    """One prompt's result: its n samples in `outputs` (index 0..n-1)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestMetrics | None = None
    prompt_logprobs: None = None  # not computed (vLLM's field, for code that reads it)


__all__ = ["CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput"]
