"""Sampling parameters and the logit transforms shared by the draft and the target model.

Speculative sampling preserves the target distribution only if the draft probabilities ``p`` and the
target probabilities ``q`` are both produced by the *same* transform of their logits, so every caller
goes through :func:`warp_logits` with one :class:`SamplingParams`.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .json_bounds import JsonBounds, loads_bounded
from .param_ranges import SAMPLING_EPS, check_sampling

logger = logging.getLogger("specoffload.sampling")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, with vLLM's names, meanings and defaults (temperature 1.0, 16 new tokens:
    ``SamplingParams()`` samples, as vLLM's does). ``temperature == 0`` means greedy decoding.

    Every field is checked against its range when the value is made (runtime/param_ranges.py).
    max_new_tokens (also accepted as vLLM's ``max_tokens``; `max_tokens` reads it back): new tokens at most.
    temperature: 0 (and anything below 1e-5, as in vLLM) is greedy.
    min_tokens: EOS and the stop ids are masked (logit -inf) until this many tokens are out.
    stop: strings that end the completion; the text is cut before the first one (kept when
    include_stop_str_in_output). stop_token_ids: ids that end it (the id is kept in token_ids).
    n: independent samples per prompt (`LLM.generate`; the Engine runs one per row).
    logprobs: the top-N log-probabilities per generated token (0: only the chosen token's), of the target's
    distribution after penalties and min_tokens, before temperature / top-k / top-p (runtime/logits_process.py).
    presence_penalty / frequency_penalty (OpenAI: subtracted per generated occurrence) and repetition_penalty
    (CTRL, Keskar et al. 2019: a seen token's positive logit divided by it, a negative one multiplied; prompt and
    output) apply to the target's logits before verification, so speculation stays lossless.
    seed: the request's own random stream (runtime/rng.py).
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, vLLM's spelling) disables top-k
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    n: int = 1
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        """Check every field against its range (param_ranges.py: one message naming the field, never a TypeError)
        and normalise: top_k -1 -> 0, a temperature below SAMPLING_EPS -> 0 (greedy, as vLLM), stop a tuple."""
        if self.top_k == -1 and type(self.top_k) is int:
            object.__setattr__(self, "top_k", 0)
        try:
            ids = tuple(operator.index(t) for t in self.stop_token_ids)
        except TypeError:
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r:.60}") from None
        object.__setattr__(self, "stop_token_ids", ids)
        check_sampling(self)  # the ranges every request is held to (param_ranges.py): checked once, here
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens = {self.max_new_tokens}], got {self.min_tokens!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r:.60}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r:.60}")
        object.__setattr__(self, "stop", tuple(stop))
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.temperature < SAMPLING_EPS:  # softmax(l / T) is one-hot to float32 precision: greedy
            object.__setattr__(self, "temperature", 0.0)

    @property
    def max_tokens(self) -> int:
        """vLLM's name of max_new_tokens."""
        return self.max_new_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def warp(self) -> tuple[float, float, int]:
        """(temperature, top_p, top_k): what a row's logits go through (`warp_rows`)."""
        return (float(self.temperature), float(self.top_p), int(self.top_k))


_dataclass_init = SamplingParams.__init__


@functools.wraps(_dataclass_init)
def _init(self: SamplingParams, *args: Any, max_tokens: int | None = None, **kwargs: Any) -> None:
    """The dataclass's __init__, also taking vLLM's `max_tokens` for max_new_tokens (one of the two, or equal)."""
    if max_tokens is not None:
        given = kwargs.get("max_new_tokens", args[0] if args else None)
        if given is not None and given != max_tokens:
            raise ValueError(f"max_tokens = {max_tokens!r} and max_new_tokens = {given!r}: give one of them")
        if args:
            args = (max_tokens, *args[1:])
        else:
            kwargs["max_new_tokens"] = max_tokens
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _init  # type: ignore[method-assign]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dimension: ``[..., vocab] -> [...]`` (LongTensor, first index on ties)."""
    return logits.argmax(dim=-1)


def warp_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Turn logits ``[..., vocab]`` into float32 probabilities ``[..., vocab]``.

    Order: temperature scaling (``softmax(logits / T)``), then top-k (keep the ``top_k`` largest,
    ``0`` = off), then top-p (nucleus: keep the smallest set of most likely tokens whose mass is
    ``>= top_p``; the argmax is always kept), then renormalise. ``temperature == 0`` is the greedy
    limit: a one-hot distribution on the argmax.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    if temperature == 0:
        one_hot = torch.zeros_like(logits)
        return one_hot.scatter_(-1, greedy_tokens(logits).unsqueeze(-1), 1.0)
    logits = logits / temperature
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).indices  # [..., top_k]
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, kth, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [..., vocab]
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly more likely tokens
        keep_sorted = mass_before < top_p
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def warp_rows(logits: torch.Tensor, warps: Sequence[Sequence[float]]) -> torch.Tensor:
    """Per-row `warp_logits`: logits [rows, ..., vocab], row r warped by warps[r] = (temperature, top_p, top_k)
    -> float32 probabilities of the same shape (rows sharing a warping are warped together). A greedy row
    (temperature 0) gets a one-hot distribution, so rejection sampling of its drafts is greedy matching."""
    groups: dict[tuple[float, float, int], list[int]] = {}
    for r, (t, p, k) in enumerate(warps):
        groups.setdefault((float(t), float(p), int(k)), []).append(r)
    if len(groups) == 1:
        return warp_logits(logits, *next(iter(groups)))
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for (t, p, k), rows in groups.items():
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        out[index] = warp_logits(logits[index], t, p, k)
    return out


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One categorical sample per row: ``[rows, vocab] -> [rows]`` (weights need not be normalised)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator] | None) -> torch.Tensor:
    """One categorical sample per row, row b from its own generator (None: torch's global one): [rows, vocab] ->
    [rows]. A row's sample then depends on its own stream only, never on the rows beside it (runtime/rng.py)."""
    if generators is None:
        return sample(probs)
    if len(generators) != probs.shape[0]:
        raise ValueError(f"{len(generators)} generators for {probs.shape[0]} rows")
    rows = [torch.multinomial(probs[b].cpu(), 1, generator=g) for b, g in enumerate(generators)]
    return torch.cat(rows).to(probs.device)


#: generation_config.json keys a model's default SamplingParams takes (vLLM's `generation_config="auto"`) -> fields
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def model_defaults(model: str | Path) -> tuple[dict[str, Any], str]:
    """The sampling fields a request without its own takes, as in vLLM, and where they come from: the model's
    generation_config.json (temperature, top_p, top_k, repetition_penalty, max_new_tokens; `do_sample: false` is
    greedy, as in transformers) over SamplingParams' own defaults (vLLM's). A value out of range in the file: the
    class's defaults, and a warning saying so."""
    path = Path(model) / "generation_config.json"
    try:
        found = loads_bounded(path.read_bytes(), JsonBounds(max_depth=4, max_digits=32))
    except (OSError, ValueError):
        return {}, "vLLM's defaults (the model has no readable generation_config.json)"
    found = found if isinstance(found, dict) else {}
    fields = {ours: found[key] for key, ours in GENERATION_KEYS.items() if found.get(key) is not None}
    said = dict(fields)
    if found.get("do_sample") is False:
        fields["temperature"] = 0.0
        said.pop("temperature", None)
        said["do_sample"] = "false: greedy"
    try:
        SamplingParams(**fields)
    except ValueError as err:  # a value out of range in the model's file
        logger.warning("%s: %s; using vLLM's defaults", path, err)
        return {}, f"vLLM's defaults ({path.name} has a value out of range)"
    if not fields:
        return {}, f"vLLM's defaults ({path.name} sets none of {', '.join(GENERATION_KEYS)})"
    return fields, f"{path.name} ({', '.join(f'{k} {v}' for k, v in said.items())}) over vLLM's defaults"
