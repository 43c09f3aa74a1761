"""Model-free draft proposals by matching text: prompt lookup (n-grams) and suffix matching with frequencies. Pure
Python over token lists, no torch: what the "ngram" and "suffix" drafters (modelfree.py) propose per row.

    ngram_reference   prompt lookup by brute force (the definition; tests compare `NgramIndex` with it)
    NgramIndex        the same proposal from an incremental index: O(max_n - min_n + 1) dict operations and
                      entries per token appended (linear in the row's length), per truncated token and per proposal
    SuffixIndex       positions of every token and token pair of a sequence; `propose` matches the query's
                      longest suffix (up to max_depth tokens) and walks the most frequent continuation, each token
                      with its empirical probability (SuffixDecoding, Oliaro et al. 2024, a path of its tree)
    suffix_reference  the suffix proposal by brute force (the definition)

Prompt lookup (Saxena 2023; vLLM's `prompt_lookup_min` / `prompt_lookup_max`): for n from max_n down to min_n,
if the row's last n tokens occurred earlier in the row (an occurrence that ends before the last token; it may
overlap the suffix), propose the (up to k) tokens that followed the most recent such occurrence; the first n that
matches wins. No match: nothing.

Suffix matching: the match length m is the longest m <= max_depth such that the query's last m tokens occur in
the indexed sequence followed by a token (at end positions `occ`). Walking: at each step the continuations of the
occurrences are counted; the most frequent one y is proposed (ties: the most recent occurrence) with probability
c(y) / (occurrences with a continuation), the path's probability is the product of these, and the walk stops
before the path's probability drops below `min_prob`, at k tokens, or at ceil(spec_factor * m) tokens (a short
match proposes little). The proposal's `score` is the sum of its prefixes' probabilities: the expected number of
its tokens a frequency-faithful target would accept. Negative tokens are separators: never matched, never
proposed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["NgramIndex", "Proposal", "SuffixIndex", "ngram_reference", "suffix_reference"]


def ngram_reference(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup by brute force: see the module docstring."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = list(tokens[size - n:])
        for start in range(size - n - 1, -1, -1):  # the most recent occurrence ending before the last token
            if list(tokens[start: start + n]) == suffix:
                return list(tokens[start + n: start + n + k])
    return []


class NgramIndex:
    """Prompt lookup over one row's tokens, kept incrementally: `table` maps the hash of each n-gram (min_n <= n <=
    max_n) that is followed by a token to the positions of those following tokens, in increasing order (the last is
    the most recent occurrence). Keys are hashes, not the n-grams themselves, so the index holds
    (max_n - min_n + 1) small entries per token, linear in the row's length; `propose` checks a candidate's tokens
    before using it (two n-grams of one hash never mix). `extend` appends tokens and indexes them; `truncate` pops
    the entries of the removed positions, so the index always equals the one built from scratch on `tokens`."""

    __slots__ = ("max_n", "min_n", "table", "tokens")

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.table: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Sequence[int]) -> None:
        """Append tokens; every n-gram now followed by a token gets that token's position."""
        tokens, table = self.tokens, self.table
        for token in new:
            c = len(tokens)  # the new token's position: it follows the n-grams ending at c - 1
            tokens.append(int(token))
            for n in range(self.min_n, min(self.max_n, c) + 1):
                key = hash(tuple(tokens[c - n: c]))
                entry = table.get(key)
                if entry is None:
                    table[key] = [c]
                else:
                    entry.append(c)

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (exactly as if only they had been appended)."""
        tokens, table = self.tokens, self.table
        for c in range(len(tokens) - 1, max(length, 0) - 1, -1):
            for n in range(self.min_n, min(self.max_n, c) + 1):
                key = hash(tuple(tokens[c - n: c]))
                entry = table[key]
                entry.pop()  # c is the entry's last position: positions were appended in increasing order
                if not entry:
                    del table[key]
        del tokens[max(length, 0):]

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest suffix n-gram."""
        tokens, size = self.tokens, len(self.tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            suffix = tokens[size - n:]
            for start in reversed(self.table.get(hash(tuple(suffix)), ())):
                if tokens[start - n: start] == suffix:  # (not another n-gram of the same hash)
                    return tokens[start: start + k]
        return []


@dataclass(frozen=True)
class Proposal:
    """Proposed tokens with their path probabilities (`probs[i]`: of tokens[: i + 1]), the match length, and the
    score: sum(probs), the expected accepted tokens if the target follows the observed frequencies."""

    tokens: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    match: int = 0

    @property
    def score(self) -> float:
        return float(sum(self.probs))


NO_PROPOSAL = Proposal()


def _walk(tokens: Sequence[int], occ: list[int], match: int, k: int, min_prob: float, spec_factor: float,
          ) -> Proposal:
    """From occurrences `occ` (end positions of the matched suffix in tokens), propose greedily: see the module
    docstring."""
    limit = min(k, math.ceil(spec_factor * match))
    size = len(tokens)
    out: list[int] = []
    probs: list[float] = []
    prob = 1.0
    while len(out) < limit:
        counts: dict[int, int] = {}
        last: dict[int, int] = {}
        total = 0
        for p in occ:
            if p + 1 < size:
                y = tokens[p + 1]
                if y < 0:
                    continue
                counts[y] = counts.get(y, 0) + 1
                last[y] = p + 1
                total += 1
        if not total:
            break
        best = max(counts, key=lambda y: (counts[y], last[y]))
        step = prob * counts[best] / total
        if step < min_prob:
            break
        prob = step
        out.append(best)
        probs.append(prob)
        occ = [p + 1 for p in occ if p + 1 < size and tokens[p + 1] == best]
    return Proposal(tuple(out), tuple(probs), match)


def suffix_reference(tokens: Sequence[int], query: Sequence[int], k: int, max_depth: int, min_prob: float,
                     spec_factor: float) -> Proposal:
    """The suffix proposal by brute force: see the module docstring (k <= 0: nothing)."""
    if k <= 0:
        return NO_PROPOSAL
    size, best_m, best_occ = len(tokens), 0, []
    for m in range(1, min(max_depth, len(query)) + 1):
        suffix = list(query[len(query) - m:])
        if min(suffix) < 0:
            break
        occ = [p for p in range(m - 1, size - 1) if list(tokens[p - m + 1: p + 1]) == suffix]
        if not occ:
            break
        best_m, best_occ = m, occ
    if not best_m:
        return NO_PROPOSAL
    return _walk(tokens, best_occ, best_m, k, min_prob, spec_factor)


class SuffixIndex:
    """The positions of every token (`unigrams`) and token pair (`bigrams`, by its second token's position) of
    `tokens`, in increasing order, kept incrementally like `NgramIndex`; `propose` is `suffix_reference` for a
    query (the row itself, or another row against this index). A match starts from the pair's positions (the
    unigram's when the pair never occurred) and scans at most `max_scan` of the most recent ones, so a common
    token in a long index costs a bounded time (then the counts are those of the recent occurrences)."""

    __slots__ = ("bigrams", "max_scan", "tokens", "unigrams")

    def __init__(self, max_scan: int = 256) -> None:
        self.tokens: list[int] = []
        self.unigrams: dict[int, list[int]] = {}
        self.bigrams: dict[tuple[int, int], list[int]] = {}
        self.max_scan = max_scan

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Sequence[int]) -> None:
        tokens, uni, bi = self.tokens, self.unigrams, self.bigrams
        for token in new:
            token = int(token)
            p = len(tokens)
            tokens.append(token)
            if token < 0:
                continue
            uni.setdefault(token, []).append(p)
            if p and tokens[p - 1] >= 0:
                bi.setdefault((tokens[p - 1], token), []).append(p)

    def truncate(self, length: int) -> None:
        tokens, uni, bi = self.tokens, self.unigrams, self.bigrams
        for p in range(len(tokens) - 1, max(length, 0) - 1, -1):
            token = tokens[p]
            if token < 0:
                continue
            _pop(uni, token)
            if p and tokens[p - 1] >= 0:
                _pop(bi, (tokens[p - 1], token))
        del tokens[max(length, 0):]

    def propose(self, query: Sequence[int], k: int, max_depth: int, min_prob: float, spec_factor: float,
                ) -> Proposal:
        """The proposal continuing `query` from this index's text (see the module docstring)."""
        if k <= 0 or not query or query[-1] < 0:
            return NO_PROPOSAL
        tokens, size = self.tokens, len(self.tokens)
        occ: list[int] = []
        m = 0
        if len(query) >= 2 and max_depth >= 2 and query[-2] >= 0:  # the pair first, then the token alone
            occ = [p for p in self.bigrams.get((query[-2], query[-1]), ())[-self.max_scan:] if p + 1 < size]
            m = 2 if occ else 0
        if not occ:
            occ = [p for p in self.unigrams.get(query[-1], ())[-self.max_scan:] if p + 1 < size]
            m = 1
        if not occ:
            return NO_PROPOSAL
        while m < min(max_depth, len(query)):
            want = query[len(query) - m - 1]
            if want < 0:
                break
            longer = [p for p in occ if p - m >= 0 and tokens[p - m] == want]
            if not longer:
                break
            occ, m = longer, m + 1
        return _walk(tokens, occ, m, k, min_prob, spec_factor)


def _pop(table: dict, key: object) -> None:
    entry = table[key]
    entry.pop()
    if not entry:
        del table[key]
