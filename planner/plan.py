"""`Plan`: what the engine runs, decided once, before the first token.

    batch        rows per batch (each of the two interleaved batches when drafting)
    k            draft tokens per verify round at the start (0 = no speculation)
    k_max        the most draft tokens a round may take: online re-planning moves k within 1..k_max; 0 means no
                 drafter is loaded and one batch is verified every pass (layer streaming only, FlexGen style)
    max_seq_len  prompt + output tokens per row the KV caches are sized for
    draft_experts  with a resident-expert drafter (draft="self"): the routed experts per layer it keeps
    interleave   with a drafter: two batches alternate (the drafter proposes for one while the target verifies the
                 other); False: one batch drafts for itself between its own passes (half the KV memory of two
                 batches for the same rows per pass; the draft steps are not hidden behind a pass)
    refill       a finished row's slot takes a waiting prompt at once (the engine's continuous batching); the
                 planner then priced the steady state of refilled batches (planner/cost.py); False: waves
    prefill_chunk  prompt tokens one streamed pass feeds at most, None: whole prompts. The planner's rule
                 (planner/cost.py `prefill_budget`): the tokens whose compute fits the headroom a pass's io leaves
                 over its decode compute, (T_io - C_decode) / (compute seconds per prompt token), at least the
                 prompt tokens a pass must take for the prompts to keep up (rows finishing per pass x the mean
                 prompt length), at least 1; None when nothing streams, with refill off, or a fixed plan. The
                 engine's own `EngineConfig.prefill_chunk`, when set, wins.

Speculation off is k = 0 (and k_max = 0) everywhere; nothing else encodes it. The planner's `Policy` (when the
planner chose) rides along for reports. `fixed_plan` and `planned` are the only constructors the runtime uses:
`runtime/planning.py` picks between them from the config, for the engine and for `specoffload plan` alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from .search import Policy, SearchResult

#: largest k the planner considers, and the ceiling online re-planning may move k to
MAX_AUTO_K = 8


@dataclass(frozen=True)
class Plan:
    """See the module docstring."""

    batch: int
    k: int
    k_max: int
    max_seq_len: int
    policy: Policy | None = None
    alternatives: tuple[Policy, ...] = ()
    draft_experts: int = 0
    interleave: bool = True
    refill: bool = True
    prefill_chunk: int | None = None
    kv_expected_tokens: int = 0  # paged target KV: positions per row placed by expected use (0: by the context)

    def __post_init__(self) -> None:
        for name, low in (("batch", 1), ("k", 0), ("k_max", 0), ("max_seq_len", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"Plan.{name} must be an integer >= {low}, got {value!r}")
        chunk = self.prefill_chunk
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"Plan.prefill_chunk must be an integer >= 1 or None, got {chunk!r}")
        if self.k > self.k_max or (self.k == 0) != (self.k_max == 0):
            raise ValueError(f"Plan: k = {self.k} must lie in 1..k_max = {self.k_max}, or both be 0")

    @property
    def drafting(self) -> bool:
        """A drafter is loaded and two batches alternate."""
        return self.k_max > 0

    @property
    def num_batches(self) -> int:
        return 2 if self.drafting and self.interleave else 1

    @property
    def kv_capacity(self) -> int:
        """KV positions per row: max_seq_len plus the k_max + 1 speculative positions of a verify pass."""
        return self.max_seq_len + self.k_max + 1

    def describe(self) -> str:
        how = "planned" if self.policy is not None else "fixed"
        batches = "two batches" if self.interleave else "one batch drafting between its passes"
        spec = f"k={self.k} (at most {self.k_max}), {batches}" if self.drafting else "no speculation, one batch"
        rows = "" if self.refill else ", waves (no refill)"
        chunk = f", at most {self.prefill_chunk} prompt tokens per pass" if self.prefill_chunk is not None else ""
        return f"batch={self.batch}, {spec}{rows}{chunk}, max_seq_len={self.max_seq_len} ({how})"


def fixed_plan(batch: int, k: int, max_seq_len: int, draft_experts: int = 0, interleave: bool = True,
               refill: bool = True, prefill_chunk: int | None = None) -> Plan:
    """The user chose batch and k (k = 0: no speculation)."""
    return Plan(batch=batch, k=k, k_max=k, max_seq_len=max_seq_len, draft_experts=draft_experts if k else 0,
                interleave=interleave, refill=refill, prefill_chunk=prefill_chunk)


def planned(result: SearchResult, max_seq_len: int, auto_k: bool, draft_experts: int = 0) -> Plan:
    """The planner's best policy. auto_k: k was "auto", so online re-planning may move it up to MAX_AUTO_K."""
    best = result.best
    k_max = max(best.k, MAX_AUTO_K) if best.k and auto_k else best.k
    return Plan(batch=best.decode_batch, k=best.k, k_max=k_max, max_seq_len=max_seq_len, policy=best,
                alternatives=result.alternatives, draft_experts=draft_experts if best.k else 0,
                interleave=best.interleave, refill=best.refill, prefill_chunk=best.prefill_chunk,
                kv_expected_tokens=best.kv_expected_tokens)
