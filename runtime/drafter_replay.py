"""A model-free drafter's acceptance on a job's own prompts, by replay: no model call.

The target's warm-up outputs (runtime/warmup.py) are replayed through the drafter's own matching code
(runtime/offload/modelfree.py, the same `propose` the runners call): at each round the drafter sees the row's
context (prompt + output so far), proposes up to k tokens, the round accepts the longest prefix equal to the
output's next tokens and commits one more (the target's correction or bonus token), as greedy verification does.
Rows run one after another through one drafter, so the suffix drafter's job-wide index holds the earlier rows'
outputs, as in a job. Each round gives (proposed L, accepted A): planner/acceptance.py `RaggedAcceptance` prices
them (match rate P(L >= 1), E[fed](k), E[tokens](k)). A sampled warm-up output is replayed the same way: with a
point-mass draft x, a position is accepted with probability p(x) (Leviathan et al. 2023, Algorithm 1), which is the
chance that the target's sampled token equals x, so the replay's acceptance is unbiased there too.

The proposal cost is timed as well: wall seconds of one row's round-start call (index the new tokens, match,
propose), the median over every round (on shared cores: an upper bound). scripts/drafter_acceptance.py runs the
same replay on reference outputs to choose the drafters' defaults.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from specoffload.planner.acceptance import RaggedAcceptance

from .config import EngineConfig
from .offload.drafters import drafter_named
from .sampling import SamplingParams


def replay_rounds(drafter: object, rows: Sequence[tuple[Sequence[int], Sequence[int]]],
                  k: int) -> tuple[list[tuple[int, int]], list[float]]:
    """Replay (prompt, output) rows through a model-free drafter (its `propose` protocol, batch 0, one row):
    ((proposed, accepted) per round, seconds of each round-start proposal). A round's proposal is cut to the
    output left after its committed token (nothing past the output's end can be checked)."""
    rounds: list[tuple[int, int]] = []
    seconds: list[float] = []
    drafter.reset(0, 1, 0)
    for prompt, output in rows:
        drafter.reset_rows(0, [0], 0)
        context = list(prompt)
        i = 0
        while i < len(output):
            held = drafter.lengths(0)[0]
            new = context[held:]
            start = time.perf_counter()
            drafter.propose(0, torch.tensor([new], dtype=torch.long), torch.tensor([len(new)]),
                            SamplingParams(temperature=0.0))
            seconds.append(time.perf_counter() - start)
            proposal = drafter.rounds[0][0][: min(k, len(output) - i - 1)]
            accepted = 0
            while accepted < len(proposal) and proposal[accepted] == output[i + accepted]:
                accepted += 1
            context += output[i: i + accepted + 1]
            i += accepted + 1
            rounds.append((len(proposal), accepted))
            drafter.truncate(0, [held + len(new)])
    drafter.drop(0)
    return rounds, seconds


def replay_acceptance(config: EngineConfig, name: str, rows: Sequence[tuple[Sequence[int], Sequence[int]]],
                      k: int) -> RaggedAcceptance:
    """The model-free drafter `name` (with config's settings: prompt_lookup_*, suffix_*) replayed on rows at k
    (module docstring); ValueError when the rows hold no round (every output empty)."""
    cls = drafter_named(name)
    if not cls.model_free:
        raise ValueError(f"drafter {name!r} holds a model: its acceptance is measured by a warm-up, not a replay")
    drafter = cls(replace(config, drafter=name, draft=None, num_draft_tokens=k), None, None, max_tokens=k)
    rounds, seconds = replay_rounds(drafter, rows, k)
    if not rounds:
        raise ValueError("the warm-up generated no tokens to replay")
    return RaggedAcceptance.from_rounds(rounds, k, proposal_s=statistics.median(seconds))

