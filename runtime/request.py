"""Per-request decoding state and the result handed back to the caller."""

from __future__ import annotations

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

    seed: the row's own random stream (runtime/rng.py `row_seed` of the job seed and the row's key); None for a
    greedy row, which draws nothing."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    seed: int | None = None
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
