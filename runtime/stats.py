"""Totals of one `generate` call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GenerateStats:
    """Totals for one `generate` call (phase seconds: resident engine, phases in sequence; offloaded, busy time
    of the draft, target and verify ops, which overlap)."""

    num_prompts: int
    prompt_tokens: int
    generated_tokens: int
    num_drafted: int
    num_accepted: int
    steps: int
    wall_s: float
    prefill_s: float
    draft_s: float
    target_s: float
    verify_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0


@dataclass(frozen=True)
class OffloadStats(GenerateStats):
    """GenerateStats plus what moved: bytes read from the weights tier, and the pipeline's target passes.

    With a resident-expert drafter: expert_picks = the target's routing picks (token, expert) seen by `adapt`,
    expert_hits = those whose expert was resident in the drafter at the time; migrated_* = what moving the
    resident set cost; expert_hotness[j][e] = tokens the target routed to expert e of layer j ([] if dense)."""

    bytes_read: int = 0
    passes: int = 0
    expert_hits: int = 0
    expert_picks: int = 0
    migrated_bytes: int = 0
    migrated_experts: int = 0
    migrations: int = 0
    expert_hotness: tuple[tuple[int, ...], ...] = ()
    preempted: int = 0  # rows preempted to free paged KV blocks (each fed again whole later)

    @property
    def expert_hit_rate(self) -> float | None:
        return self.expert_hits / self.expert_picks if self.expert_picks else None


class RequestTotals:
    """The GenerateStats fields that sum over a call's requests (runtime/request.py `Request`), added up as each
    request finishes, so a job keeps counters, not its finished requests (memory flat however many rows run)."""

    FIELDS = ("num_prompts", "prompt_tokens", "generated_tokens", "num_drafted", "num_accepted")

    def __init__(self) -> None:
        self.num_prompts = self.prompt_tokens = self.generated_tokens = self.num_drafted = self.num_accepted = 0

    def add(self, r: Any) -> None:
        self.num_prompts += 1
        self.prompt_tokens += len(r.prompt)
        self.generated_tokens += len(r.output)
        self.num_drafted += r.num_drafted
        self.num_accepted += r.num_accepted

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.FIELDS}
