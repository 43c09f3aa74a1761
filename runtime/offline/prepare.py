"""From a parsed row to what the engine runs: token ids and the row's own SamplingParams (its stop strings
included: the engine ends the row at the token that completes one and cuts the text before it, runtime/request.py
and `Engine`'s results: the one place stop strings are cut).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..bounded_encode import TooLong, encode_bounded
from ..sampling import SamplingParams
from .rows import RowError, RowJob, RowRequest

#: SamplingParams fields a row may set for itself (OpenAI batch body fields, by SamplingParams name)
ROW_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "min_tokens", "presence_penalty",
              "frequency_penalty", "repetition_penalty", "n", "logprobs")


@dataclass(frozen=True)
class Limits:
    """What a prompt must fit: the target's vocabulary and context, and the KV length per row (None while the job's
    own is being measured)."""

    vocab_size: int
    context: int
    max_seq_len: int | None = None


class Preparer:
    """RowRequest -> RowJob (or RowError). defaults: the command line's sampling parameters, for what a row leaves
    out (its seed included: a sampled row draws from (seed, its index) alone, runtime/rng.py, so a resumed row
    draws as before whatever the chunking)."""

    def __init__(self, tokenizer: Any | None, limits: Limits, defaults: SamplingParams, chunk_size: int) -> None:
        self.tokenizer, self.limits, self.defaults, self.chunk_size = tokenizer, limits, defaults, chunk_size

    def __call__(self, item: RowRequest | RowError) -> RowJob | RowError:
        if isinstance(item, RowError):
            return item
        try:
            ids = self._encode(item)
        except ValueError as err:  # text that is not Unicode (bounded_encode.py)
            return _error(item, "invalid_request", str(err))
        if isinstance(ids, RowError):
            return ids
        try:
            params = self._params(item)
        except ValueError as err:  # a range (param_ranges.py), or a stop string that is not Unicode
            return _error(item, "invalid_parameter", str(err))
        return RowJob(item, tuple(ids), params)

    def _encode(self, r: RowRequest) -> list[int] | RowError:
        tok, lim = self.tokenizer, self.limits
        limit = lim.context if lim.max_seq_len is None else min(lim.context, lim.max_seq_len)
        if r.messages is not None:
            if tok is None or not getattr(tok, "chat_template", None):
                return _error(r, "no_chat_template", "the target has no chat template: send /v1/completions requests "
                                                     "(text or token ids) instead")
            try:
                text = tok.apply_chat_template(list(r.messages), tokenize=False, add_generation_prompt=True)
            except Exception as err:  # noqa: BLE001 - a template may raise anything (jinja); the row fails, not the job
                return _error(r, "invalid_parameter", f"the chat template refused the messages: {err}")
            ids = encode_bounded(tok, text, limit)
        elif isinstance(r.prompt, str):
            if tok is None:
                return _error(r, "invalid_request", "the prompt is text but the target has no tokenizer: "
                                                    "send token ids")
            ids = encode_bounded(tok, r.prompt, limit)  # a prefix only, when that shows it is too long
        else:
            ids = list(r.prompt or ())
            vocab = self.limits.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                return _error(r, "invalid_request", f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if isinstance(ids, TooLong):
            where = "the target's context" if limit == lim.context else "the KV caches' length per row (--max-seq-len)"
            return _error(r, "prompt_too_long", f"the prompt has at least {ids.at_least} tokens (counted on a prefix); "
                                                f"{where} is {limit} tokens")
        n = len(ids)
        if n == 0:
            return _error(r, "empty_prompt", "the prompt is empty")
        if n >= lim.context:
            return _error(r, "prompt_too_long", f"the prompt has {n} tokens; the target's context is {lim.context} "
                                                "tokens (a prompt must leave room for at least one new token)")
        if lim.max_seq_len is not None and n >= lim.max_seq_len:
            return _error(r, "prompt_too_long", f"the prompt has {n} tokens; the KV caches hold {lim.max_seq_len} "
                                                "tokens per row (--max-seq-len)")
        return ids

    def _params(self, r: RowRequest) -> SamplingParams:
        d, o = self.defaults, r.overrides
        stop = o.get("stop", d.stop)
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need the target's tokenizer (it has none)")
        fields = {k: o[k] for k in ROW_FIELDS if k in o}
        # the engine ends a row at its stop string and cuts the text; a field out of range is a ValueError naming it
        return replace(d, stop=stop, **fields)



def _error(r: RowRequest, code: str, message: str) -> RowError:
    return RowError(r.index, r.lineno, code, message, r.custom_id)
