"""The ranges of the sampling fields every row is checked against before it runs (a job's rows, `Engine.generate`'s
requests, `LLM`'s and the command line's defaults alike), so an out-of-range value is one error naming its field,
never an overflow deep in the run (or on the wire: msgpack carries integers of at most 64 bits).

  seed                an integer in 0 .. 2**64 - 1 (what the Batch API and vLLM take); it is hashed with the row's key
                      into the row's stream (runtime/rng.py), so every value in the range is its own stream
  max_new_tokens      an integer in 1 .. 2**31 - 1 (a row stops at its KV length anyway: finish_reason "length")
  min_tokens          an integer in 0 .. 2**31 - 1 (and at most max_new_tokens: sampling.py)
  temperature         a finite number >= 0 (0: greedy; below SAMPLING_EPS it is made 0, as vLLM does, since
                      softmax(l / T) is one-hot to float32 precision there and l / T overflows for T < ~1e-37)
  top_p               a number in (0, 1]
  top_k               an integer in 0 .. 2**31 - 1 (0: off; a row's -1 means off too)
  presence_penalty,
  frequency_penalty   numbers in [-2, 2] (OpenAI's range)
  repetition_penalty  a number in [0.01, 100] (1: off). A seen token's logit l becomes l / rp or l * rp: outside
                      this range the factor dwarfs any logit (rp = 100 already moves a logit of 1 by 99) and, at the
                      extremes, l / rp overflows to inf and softmax to NaN
  n                   an integer in 1 .. MAX_N (samples per prompt: the Batch API's bound)
  logprobs            None, or an integer in 0 .. 2**31 - 1 (the engine further caps it at its max_logprobs, by
                      default MAX_LOGPROBS, as vLLM does)
  stop_token_ids      integers in 0 .. 2**31 - 1
"""

from __future__ import annotations

import math
from typing import Any

SEED_MAX = 2**64 - 1
INT32_MAX = 2**31 - 1
SAMPLING_EPS = 1e-5  # a temperature below it is greedy (vLLM's _SAMPLING_EPS)
MAX_N = 16  # samples per prompt
MAX_LOGPROBS = 20  # top-N log-probabilities per token: the OpenAI API's bound and vLLM's default max_logprobs

#: field -> (kind, lowest, highest); kind "int" (bool refused) or "float" (finite; an int is taken)
RANGES: dict[str, tuple[str, float, float]] = {
    "seed": ("int", 0, SEED_MAX),
    "max_new_tokens": ("int", 1, INT32_MAX),
    "min_tokens": ("int", 0, INT32_MAX),
    "temperature": ("float", 0.0, math.inf),
    "top_p": ("float", 0.0, 1.0),  # 0 excluded
    "top_k": ("int", 0, INT32_MAX),
    "presence_penalty": ("float", -2.0, 2.0),
    "frequency_penalty": ("float", -2.0, 2.0),
    "repetition_penalty": ("float", 0.01, 100.0),
    "n": ("int", 1, MAX_N),
    "logprobs": ("int", 0, INT32_MAX),
}
_OPTIONAL = ("seed", "logprobs")  # None: unset
_TOPS = {SEED_MAX: "2**64 - 1", INT32_MAX: "2**31 - 1"}


def range_problem(field: str, value: Any, shown: str | None = None) -> str | None:
    """What is wrong with `value` for `field` (named `shown` in the message), or None when it is in range."""
    kind, lo, hi = RANGES[field]
    name = shown or field
    if kind == "int":
        if type(value) is not int or not lo <= value <= hi:
            return f"'{name}' must be an integer in {lo} .. {_TOPS.get(hi, hi)}, got {_short(value)}"
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"'{name}' must be a finite number, got {_short(value)}"
    if field == "top_p" and not 0 < value <= 1:
        return f"'{name}' must be in (0, 1], got {_short(value)}"
    if not lo <= value <= hi:
        return f"'{name}' must be >= {lo}, got {_short(value)}" if hi == math.inf else \
            f"'{name}' must be in [{lo}, {hi}], got {_short(value)}"
    return None


def check_sampling(params: Any) -> None:
    """Raise ValueError naming the first field of a SamplingParams out of its range (see the module docstring)."""
    for field in RANGES:
        value = getattr(params, field)
        if field in _OPTIONAL and value is None:
            continue
        problem = range_problem(field, value)
        if problem is not None:
            raise ValueError(problem)
    bad = [t for t in getattr(params, "stop_token_ids", ()) if type(t) is not int or not 0 <= t <= INT32_MAX]
    if bad:
        raise ValueError(f"'stop_token_ids' must be integers in 0 .. 2**31 - 1, got {_short(bad[0])}")


def overrides_problem(values: dict[str, Any], shown: dict[str, str]) -> str | None:
    """The first of a row's fields (by SamplingParams name) out of range, named as the row named it (`shown`)."""
    for field, value in values.items():
        if field in RANGES:
            problem = range_problem(field, value, shown.get(field, field))
            if problem is not None:
                return problem
    return None


def _short(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 96:
        return f"an integer of {value.bit_length()} bits"  # never str() it: long ints convert in O(n^2)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
