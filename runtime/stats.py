"""Totals of one `generate` call."""

from __future__ import annotations

from collections.abc import Iterable
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


def request_totals(requests: Iterable[Any]) -> dict[str, int]:
    """The GenerateStats fields that sum over a call's requests (runtime/request.py `Request`)."""
    requests = list(requests)
    return {
        "num_prompts": len(requests),
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "generated_tokens": sum(len(r.output) for r in requests),
        "num_drafted": sum(r.num_drafted for r in requests),
        "num_accepted": sum(r.num_accepted for r in requests),
    }
