"""Model-free drafters: propose by matching text, with no weights, no KV cache and no device time.

    NgramDrafter   "ngram": prompt lookup (matching.py `NgramIndex`) over each row's prompt and output
    SuffixDrafter  "suffix": suffix matching (matching.py `SuffixIndex`) over each row's prompt and output and
                   over the job's finished outputs, each proposal with a score; the better-scoring one is proposed

Both keep per row the committed tokens the runner fed them (`lengths` says how many; `truncate` drops what the
target rejected), exactly as a draft model keeps its KV cache, and index them only at a round's first call (when
every token held is committed). A round's first call proposes each row's whole draft (up to `max_tokens`); the
round's later calls hand it out one token per call, as the per-token `Drafter.propose` protocol asks. A row whose
proposal is shorter answers `NO_TOKEN` (-1) from then on: the runner verifies only the drafts before it
(runtime/speculative.py `cut_drafts`), so a row with no match costs its next token only, and a round in which no
row has anything left stops early. Their draft distribution is a point mass on the proposed token: they return no
probabilities, and verification treats the drafts as deterministic (speculative.py `verify_rows`: p is one-hot),
which keeps sampling exact (Leviathan et al. 2023, Algorithm 1 with p_i = 1 at x_i).

They are `model_free` (drafters.py `DrafterTraits`): placement counts nothing for them (the default footprint), a
backend builds them in the coordinator's process (no draft actor on Ray), and by default one batch drafts for
itself between its passes (a proposal costs microseconds: there is nothing to hide behind another batch's pass).

Reproducibility: "ngram" depends on the row alone, so a sampled row's output is the same whatever the batch. With
"suffix", a row's proposals also depend on the outputs of the rows that finished before it (the global index):
its output is still distributed exactly as the target's, but a seeded row's draws may differ between runs that
finish rows in another order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from specoffload.planner.plan import MAX_AUTO_K

from ...errors import ConfigError
from ...sampling import SamplingParams
from ..matching import NO_PROPOSAL, NgramIndex, Proposal, SuffixIndex
from ..wire import wire
from . import DrafterTraits, option, register_drafter

if TYPE_CHECKING:
    from ...config import EngineConfig

Tensor = torch.Tensor

#: what a model-free drafter answers for a row with nothing (more) to propose this round
NO_TOKEN = -1


#: defaults: see README "Model-free drafters" and docs/perf/drafter_acceptance.json
DEFAULT_LOOKUP_MIN = 1
DEFAULT_LOOKUP_MAX = 3
MAX_LOOKUP = 32  # the longest n-gram prompt lookup may match: its index holds max - min + 1 entries per token
DEFAULT_SUFFIX_DEPTH = 24
DEFAULT_SUFFIX_MIN_PROB = 0.1
DEFAULT_SUFFIX_SPEC_FACTOR = 1.0


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class NgramOptions:
    """The "ngram" drafter's settings (vLLM's names)."""

    prompt_lookup_min: int = option(DEFAULT_LOOKUP_MIN, "ngram: the shortest suffix n-gram looked up in the row's "
                                                        "prompt and output")
    prompt_lookup_max: int = option(DEFAULT_LOOKUP_MAX, f"ngram: the longest (at most {MAX_LOOKUP})")

    def __post_init__(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (_is_int(lo) and _is_int(hi)) or not 1 <= lo <= hi <= MAX_LOOKUP:
            raise ConfigError(f"prompt_lookup_min and prompt_lookup_max must be integers with 1 <= min <= max <= "
                              f"{MAX_LOOKUP}, got {lo!r} and {hi!r}")


@dataclass(frozen=True)
class SuffixOptions:
    """The "suffix" drafter's settings (vLLM's suffix_decoding_* names without the prefix)."""

    suffix_max_depth: int = option(DEFAULT_SUFFIX_DEPTH, "suffix: the longest suffix matched (tokens)")
    suffix_min_prob: float = option(DEFAULT_SUFFIX_MIN_PROB, "suffix: a proposal stops before its estimated "
                                                             "probability drops below this")
    suffix_spec_factor: float = option(DEFAULT_SUFFIX_SPEC_FACTOR, "suffix: a match of m tokens proposes at most "
                                                                   "factor * m")

    def __post_init__(self) -> None:
        if not _is_int(self.suffix_max_depth) or self.suffix_max_depth < 1:
            raise ConfigError(f"suffix_max_depth must be an integer >= 1, got {self.suffix_max_depth!r}")
        if isinstance(self.suffix_min_prob, bool) or not isinstance(self.suffix_min_prob, (int, float)) \
                or not 0.0 <= self.suffix_min_prob <= 1.0:
            raise ConfigError(f"suffix_min_prob must be in [0, 1], got {self.suffix_min_prob!r}")
        if isinstance(self.suffix_spec_factor, bool) or not isinstance(self.suffix_spec_factor, (int, float)) \
                or self.suffix_spec_factor <= 0:
            raise ConfigError(f"suffix_spec_factor must be > 0, got {self.suffix_spec_factor!r}")


class LookupDrafter(DrafterTraits):
    """The per-batch, per-row bookkeeping both model-free drafters share; a subclass says how a row's text is
    kept (`new_row`) and what a row proposes (`propose_row`)."""

    model_free: ClassVar[bool] = True
    offloaded_only = False

    def __init__(self, config: EngineConfig | None = None, weights: object = None, slots: object = None, *,
                 max_tokens: int | None = None) -> None:
        """max_tokens: the longest proposal per round (default: the config's k, or the planner's largest)."""
        k = config.num_draft_tokens if config is not None else None
        self.max_tokens = max_tokens if max_tokens is not None else (k if isinstance(k, int) and k > 0 else
                                                                      MAX_AUTO_K)
        self.rows: dict[int, list] = {}
        self.rounds: dict[int, list[list[int]]] = {}  # batch -> the current round's proposal per row
        self.calls: dict[int, int] = {}  # batch -> draft calls made in the current round
        self.proposed = self.matched = 0  # rows asked at a round's first call, and rows that proposed something

    # ---- subclass hooks -----------------------------------------------------------------------------------------
    def new_row(self) -> NgramIndex | SuffixIndex:
        raise NotImplementedError

    def propose_row(self, row: NgramIndex | SuffixIndex) -> list[int]:
        raise NotImplementedError

    def finished(self, row: NgramIndex | SuffixIndex) -> None:
        """A row leaves (its request finished, or its batch is dropped)."""

    # ---- the Drafter protocol -------------------------------------------------------------------------------------
    @wire
    def reset(self, batch: int, rows: int, capacity: int) -> None:
        self.drop(batch)
        self.rows[batch] = [self.new_row() for _ in range(rows)]

    @wire
    def drop(self, batch: int) -> None:
        for row in self.rows.pop(batch, []):
            self.finished(row)
        self.rounds.pop(batch, None)

    @wire
    def lengths(self, batch: int) -> list[int]:
        """Tokens held per row; called at the start of every draft round (both runners): a new round begins."""
        self.calls[batch] = 0
        return [len(row) for row in self.rows[batch]]

    @wire
    def truncate(self, batch: int, lengths: Sequence[int]) -> None:
        for row, n in zip(self.rows[batch], lengths):
            if n < len(row):
                row.truncate(int(n))

    @wire
    def select_rows(self, batch: int, keep: Sequence[int]) -> None:
        rows = self.rows[batch]
        kept = set(keep)
        for n, row in enumerate(rows):
            if n not in kept:
                self.finished(row)
        self.rows[batch] = [rows[n] for n in keep]

    @wire
    def add_rows(self, batch: int, n: int, capacity: int) -> None:
        self.rows[batch] += [self.new_row() for _ in range(n)]

    @wire
    def reset_rows(self, batch: int, rows: Sequence[int], capacity: int) -> None:
        for n in rows:
            self.finished(self.rows[batch][n])
            self.rows[batch][n] = self.new_row()

    @wire
    def propose(self, batch: int, ids: Tensor, num_new: Tensor, params: SamplingParams,
                seeds: Sequence[int] | None = None,
                warps: Sequence[Sequence[float]] | None = None) -> tuple[Tensor, Tensor | None]:
        """Feed ids [rows, T] (row r: its first num_new[r] valid) and hand out draft token t of the round per row
        (NO_TOKEN past a row's proposal); no probabilities: the drafts are deterministic. The round's first call
        (t = 0) proposes each row's whole draft from its committed tokens."""
        rows = self.rows[batch]
        t = self.calls.get(batch, 0)
        self.calls[batch] = t + 1
        fed = ids.tolist()
        counts = torch.as_tensor(num_new).tolist()
        for row, tokens, n in zip(rows, fed, counts):
            if n:
                row.extend(tokens[:n])
        if t == 0:
            self.rounds[batch] = round_ = [self.propose_row(row) for row in rows]
            self.proposed += len(rows)
            self.matched += sum(1 for p in round_ if p)
        round_ = self.rounds[batch]
        out = [p[t] if t < len(p) else NO_TOKEN for p in round_]
        return torch.tensor(out, dtype=torch.long), None  # [rows]

    @wire
    def adapt(self, routing_counts: list[list[int]]) -> list[int]:
        return [0, 0, 0, 0]


class NgramDrafter(LookupDrafter):
    """Prompt lookup: each row proposes what followed the most recent earlier occurrence of its longest suffix
    n-gram, prompt_lookup_min <= n <= prompt_lookup_max (`NgramOptions`), in its own prompt and output."""

    options = NgramOptions

    def __init__(self, config: EngineConfig | None = None, weights: object = None, slots: object = None, *,
                 max_tokens: int | None = None, min_n: int | None = None, max_n: int | None = None) -> None:
        super().__init__(config, weights, slots, max_tokens=max_tokens)
        settings = self.settings(config) if config is not None else NgramOptions()
        self.min_n = min_n or settings.prompt_lookup_min
        self.max_n = max_n or settings.prompt_lookup_max

    def new_row(self) -> NgramIndex:
        return NgramIndex(self.min_n, self.max_n)

    def propose_row(self, row: NgramIndex) -> list[int]:  # type: ignore[override]
        return row.propose(self.max_tokens)


class SuffixDrafter(LookupDrafter):
    """Suffix decoding: each row matches its longest suffix (up to suffix_max_depth tokens) in its own prompt and
    output and in the job's finished outputs (one `SuffixIndex`, updated as rows finish), walks the most frequent
    continuation in each while its probability stays >= suffix_min_prob, and proposes the one with the higher
    score (ties: the row's own). A row's output part (what it fed after its first round's context, less that
    context's last token) joins the global index when the row leaves; the global index keeps the most recent
    outputs, up to GLOBAL_TOKENS tokens."""

    options = SuffixOptions
    GLOBAL_TOKENS: ClassVar[int] = 1 << 18

    def __init__(self, config: EngineConfig | None = None, weights: object = None, slots: object = None, *,
                 max_tokens: int | None = None, max_depth: int | None = None, min_prob: float | None = None,
                 spec_factor: float | None = None) -> None:
        super().__init__(config, weights, slots, max_tokens=max_tokens)
        settings = self.settings(config) if config is not None else SuffixOptions()
        self.max_depth = max_depth or settings.suffix_max_depth
        self.min_prob = min_prob if min_prob is not None else settings.suffix_min_prob
        self.spec_factor = spec_factor if spec_factor is not None else settings.suffix_spec_factor
        self.global_index = SuffixIndex()
        self.outputs: list[list[int]] = []  # the finished outputs in the global index, oldest first
        self.starts: dict[int, int] = {}  # id(row) -> where its output starts (its first round's context - 1)
        self.last: Proposal = NO_PROPOSAL  # the last row proposal (for tests and benchmarks)

    def new_row(self) -> SuffixIndex:
        return SuffixIndex()

    def propose_row(self, row: SuffixIndex) -> list[int]:  # type: ignore[override]
        self.starts.setdefault(id(row), max(len(row) - 1, 0))
        args = (self.max_tokens, self.max_depth, self.min_prob, self.spec_factor)
        own = row.propose(row.tokens, *args)
        other = self.global_index.propose(row.tokens, *args) if len(self.global_index) else NO_PROPOSAL
        self.last = other if other.score > own.score else own
        return list(self.last.tokens)

    def finished(self, row: SuffixIndex) -> None:
        start = self.starts.pop(id(row), None)
        if start is None or start >= len(row):
            return
        output = [t for t in row.tokens[start:] if t >= 0]
        if not output:
            return
        self.outputs.append(output)
        self.global_index.extend([*output, NO_TOKEN])
        if len(self.global_index) > self.GLOBAL_TOKENS:  # keep the most recent half
            kept, total = [], 0
            for out in reversed(self.outputs):
                if total + len(out) + 1 > self.GLOBAL_TOKENS // 2:
                    break
                kept.append(out)
                total += len(out) + 1
            self.outputs = kept[::-1]
            self.global_index = SuffixIndex()
            for out in self.outputs:
                self.global_index.extend([*out, NO_TOKEN])

register_drafter("ngram", NgramDrafter)
register_drafter("suffix", SuffixDrafter)
