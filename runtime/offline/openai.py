"""The OpenAI Batch API format (what `vllm run-batch` and the hosted Batch API read and write).

Input, one request per line:

    {"custom_id": "r1", "method": "POST", "url": "/v1/completions",
     "body": {"model": "m", "prompt": "def f():", "max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "seed": 3,
              "stop": ["\\n\\n"]}}
    {"custom_id": "r2", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "Write a sort."}], "max_tokens": 128}}

`body.prompt` is a string or a list of token ids; `body.messages` goes through the target's chat template. The
body's max_tokens (max_completion_tokens), temperature, top_p, top_k, seed, stop, presence_penalty,
frequency_penalty, repetition_penalty, min_tokens, n (1 .. 16 independent samples: `choices` with index 0 .. n-1)
and logprobs are the row's own; a field the body leaves out takes the command line's value. logprobs: in a
completions body an integer 0 .. 20 (the top-N per token; the choice's `logprobs` is {"tokens", "token_logprobs",
"top_logprobs", "text_offset"}), in a chat body `"logprobs": true` with `top_logprobs` 0 .. 20 (the choice's
`logprobs` is {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}); the target's log-probabilities (after
penalties, before temperature / top-p / top-k), as vLLM reports them. Output, one line per input line, in input
order:

    {"id": "batch_req_5f0c...", "custom_id": "r1", "response": {"status_code": 200, "request_id": "req_8e1d...",
     "body": {"id": "cmpl-3b9a...", "object": "text_completion", "choices": [{"index": 0, "text": "...",
              "finish_reason": "stop", "stop_reason": "\\n\\n"}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}, ...}}, "error": null}
    {"id": "batch_req_9a7c...", "custom_id": "r2", "response": null,
     "error": {"code": "unknown_url", "message": "line 2: unknown url '/v1/embeddings' ...", "line": 2}}

Ids are random (unique across runs); a failed row is an error line in its place and the job still succeeds (exit
status 0; the summary and stderr count failed rows), as `vllm run-batch` does.
"""

from __future__ import annotations

import math
import secrets
import time
import uuid
from collections.abc import Sequence
from typing import Any

from ..param_ranges import MAX_LOGPROBS, MAX_N, overrides_problem
from .reading import RowProblem, head_custom_id, row_json
from .rows import RowError, RowJob, RowRequest, RowResult
from .simple import OutputMismatch
from .source import RawRow

URLS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
ROLES = ("system", "developer", "user", "assistant", "tool")
#: body fields accepted only at the value that means "nothing special" (what this engine does anyway)
NEUTRAL = {"best_of": (1,), "stream": (False,), "echo": (False,), "top_logprobs": (None, 0)}
LOGPROB_FLOOR = -9999.0  # what a -inf log-probability is written as (JSON has no infinity; vLLM's floor)
IGNORED = ("user",)
_SHOWN = {"max_new_tokens": "max_tokens"}  # SamplingParams name -> the body's name, in messages


class BadRow(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class OpenAIBatchFormat:
    name = "openai"

    def parse(self, raw: RawRow) -> RowRequest | RowError:
        custom_id = None
        try:
            try:
                value = row_json(raw)  # bounded: line length, nesting depth, number lengths (reading.py)
            except RowProblem as problem:
                custom_id = head_custom_id(raw) if problem.code != "invalid_json" else None
                raise BadRow(problem.code, str(problem)) from None
            if not isinstance(value, dict):
                raise BadRow("invalid_request", f"expected a JSON object, got {type(value).__name__}")
            custom_id = value.get("custom_id")
            if not isinstance(custom_id, str):
                custom_id = None
                raise BadRow("invalid_request", "'custom_id' must be a string")
            if value.get("method", "POST") != "POST":
                raise BadRow("invalid_request", f"method {value.get('method')!r}: only POST")
            url = value.get("url")
            if url not in URLS:
                raise BadRow("unknown_url", f"unknown url {url!r}: this engine serves {' and '.join(URLS)}")
            body = value.get("body")
            if not isinstance(body, dict):
                raise BadRow("invalid_request", "'body' must be an object")
            return self._request(raw, custom_id, URLS[url], body)
        except BadRow as bad:
            return RowError(raw.index, raw.lineno, bad.code, str(bad), custom_id)

    def _request(self, raw: RawRow, custom_id: str, endpoint: str, body: dict[str, Any]) -> RowRequest:
        body = dict(body)
        prompt = messages = None
        if endpoint == "completions":
            prompt = _prompt(body.pop("prompt", None))
            max_keys = ("max_tokens",)
        else:
            messages = _messages(body.pop("messages", None))
            max_keys = ("max_completion_tokens", "max_tokens")
        overrides: dict[str, Any] = {}
        for key in max_keys:
            if body.get(key) is not None:
                overrides["max_new_tokens"] = _integer(key, body.pop(key), minimum=1)
            body.pop(key, None)
        for key in ("temperature", "top_p"):
            if body.get(key) is not None:
                overrides[key] = _number(key, body.pop(key))
            body.pop(key, None)
        if body.get("top_k") is not None:
            overrides["top_k"] = max(_integer("top_k", body.pop("top_k"), minimum=-1), 0)  # -1 / 0: off
        for key in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            if body.get(key) is not None:
                overrides[key] = _number(key, body.pop(key))
            body.pop(key, None)
        if body.get("min_tokens") is not None:
            overrides["min_tokens"] = _integer("min_tokens", body.pop("min_tokens"), minimum=0)
        if body.get("n") is not None and _integer("n", body["n"], minimum=1, maximum=MAX_N) > 1:
            overrides["n"] = body["n"]  # (1 is what every row runs anyway: the command line has no n)
        body.pop("n", None)
        logprobs = _logprobs(endpoint, body)
        if logprobs is not None:
            overrides["logprobs"] = logprobs
        if body.get("seed") is not None:
            overrides["seed"] = _integer("seed", body.pop("seed"))
        problem = overrides_problem(overrides, _SHOWN | {"max_new_tokens": max_keys[0]})
        if problem is not None:
            raise BadRow("invalid_parameter", problem)
        stop = body.pop("stop", None)
        if stop is not None:
            overrides["stop"] = _stop(stop)
        model = body.pop("model", None)
        if model is not None and not isinstance(model, str):
            raise BadRow("invalid_parameter", "'model' must be a string")
        return_ids = body.pop("return_token_ids", False)
        if not isinstance(return_ids, bool):
            raise BadRow("invalid_parameter", "'return_token_ids' must be true or false")
        for key in list(body):
            if key in IGNORED or body[key] is None:
                continue
            if key in NEUTRAL:
                if not any(type(body[key]) is type(v) and body[key] == v for v in NEUTRAL[key]):
                    raise BadRow("invalid_parameter", f"{key} = {body[key]!r} is not supported "
                                                      f"(only {NEUTRAL[key][0]!r})")
                continue
            raise BadRow("invalid_parameter", f"unsupported parameter {key!r}")
        return RowRequest(raw.index, raw.lineno, endpoint, prompt=prompt, messages=messages, custom_id=custom_id,
                          overrides=overrides, model=model, return_token_ids=return_ids)

    def result_row(self, job: RowJob, result: RowResult | Sequence[RowResult], model: str,
                   tokenizer: Any = None) -> dict[str, Any]:
        """The row's response: one choice per sample (index 0 .. n-1, as the engine ran them: Chunk.jobs)."""
        r = job.request
        samples = [result] if isinstance(result, RowResult) else list(result)
        completion = sum(len(s.token_ids) for s in samples)
        usage = {"prompt_tokens": len(job.token_ids), "completion_tokens": completion,
                 "total_tokens": len(job.token_ids) + completion}
        choices = []
        for index, sample in enumerate(samples):
            logprobs = None
            if sample.logprobs is not None:
                logprobs = (_chat_logprobs if r.endpoint == "chat" else _completion_logprobs)(sample, tokenizer)
            if r.endpoint == "chat":
                choice: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": sample.text},
                                          "logprobs": logprobs, "finish_reason": sample.finish_reason,
                                          "stop_reason": sample.stop_reason}
            else:
                choice = {"index": index, "text": sample.text, "logprobs": logprobs,
                          "finish_reason": sample.finish_reason, "stop_reason": sample.stop_reason}
            if r.return_token_ids or sample.text is None:  # no tokenizer: the tokens are the output
                choice["token_ids"] = list(sample.token_ids)
            choices.append(choice)
        kind, prefix = ("chat.completion", "chatcmpl") if r.endpoint == "chat" else ("text_completion", "cmpl")
        body = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": r.model or model, "choices": choices, "usage": usage}
        return {"id": _batch_request_id(), "custom_id": r.custom_id,
                "response": {"status_code": 200, "request_id": f"req_{uuid.uuid4().hex}", "body": body}, "error": None}

    def error_row(self, error: RowError) -> dict[str, Any]:
        """A request that failed without a response: the Batch API's `error` object (code, message, and the input
        line it came from)."""
        return {"id": _batch_request_id(), "custom_id": error.custom_id, "response": None,
                "error": {"code": error.code, "message": f"line {error.lineno}: {error.message}",
                          "line": error.lineno}}

    def failed(self, row: dict[str, Any]) -> bool:
        return row.get("error") is not None

    def check_resumed(self, row: dict[str, Any], expected: RowRequest | RowError | None, total: int) -> None:
        if "custom_id" not in row or not ("response" in row or "error" in row):
            raise OutputMismatch("not a line of an OpenAI batch output (custom_id with response or error): "
                                 "cannot resume it")
        if expected is None:
            raise OutputMismatch(f"more output lines than the input has requests ({total}): it was written for "
                                 "another input; use another --output")
        if row["custom_id"] != expected.custom_id:
            raise OutputMismatch(f"custom_id {row['custom_id']!r} where the input's request {expected.index} has "
                                 f"{expected.custom_id!r} (another input, or lines missing or twice): cannot resume it")


def _batch_request_id() -> str:
    """A new output line's id, unique across runs as the Batch API's are (batch_req_ + 24 hex digits)."""
    return f"batch_req_{secrets.token_hex(12)}"


def _prompt(value: Any) -> str | tuple[int, ...]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(type(t) is int and t >= 0 for t in value):
        return tuple(value)
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        raise BadRow("invalid_parameter", "one prompt per request: a list of several prompts is not supported")
    raise BadRow("invalid_parameter", "'prompt' must be a string or a non-empty list of non-negative token ids")


def _messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise BadRow("invalid_parameter", "'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRow("invalid_parameter", f"messages[{i}] needs a role in {ROLES}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRow("invalid_parameter", f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRow("invalid_parameter", f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    return tuple(out)


def _integer(key: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    if type(value) is not int or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bound = (f" in {minimum} .. {maximum}" if maximum is not None else f" >= {minimum}" if minimum is not None
                 else "")
        raise BadRow("invalid_parameter", f"'{key}' must be an integer{bound}, got {_short(value)}")
    return value


def _logprobs(endpoint: str, body: dict[str, Any]) -> int | None:
    """The row's top-N log-probabilities per token (None: off), taken out of the body. completions: `logprobs` an
    integer 0 .. 20; chat: `logprobs` true or false, with `top_logprobs` 0 .. 20 (which needs logprobs true)."""
    value = body.pop("logprobs", None)
    if endpoint == "completions":
        return None if value is None else _integer("logprobs", value, minimum=0, maximum=MAX_LOGPROBS)
    top = body.pop("top_logprobs", None)
    if value is not None and not isinstance(value, bool):
        raise BadRow("invalid_parameter", f"'logprobs' must be true or false, got {_short(value)}")
    if not value:
        if top not in (None, 0) or type(top) is bool:
            raise BadRow("invalid_parameter", "'top_logprobs' needs 'logprobs': true")
        return None
    return 0 if top is None else _integer("top_logprobs", top, minimum=0, maximum=MAX_LOGPROBS)


def _token_text(tokenizer: Any, token: int) -> str:
    """A token as text (vLLM's "token_id:N" without a tokenizer)."""
    return tokenizer.decode([token]) if tokenizer is not None else f"token_id:{token}"


def _floor(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def _completion_logprobs(sample: RowResult, tokenizer: Any) -> dict[str, list[Any]]:
    """The completions API's shape: per token its text, its log-probability, {text: logprob} of the chosen token and
    the top-N, and its offset in the completion's text (the sum of the tokens' text lengths before it)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = 0
    for entry in sample.logprobs or ():
        chosen, lp, _ = entry[0]
        text = _token_text(tokenizer, chosen)
        tokens.append(text)
        token_lps.append(_floor(lp))
        top: dict[str, float] = {}
        for t, x, _rank in entry:  # the chosen token first, then the top-N
            top.setdefault(_token_text(tokenizer, t), _floor(x))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(sample: RowResult, tokenizer: Any) -> dict[str, list[Any]]:
    """The chat API's shape: per token {token, logprob, bytes, top_logprobs: the top-N, each {token, logprob,
    bytes}}."""
    def item(t: int, x: float) -> dict[str, Any]:
        text = _token_text(tokenizer, t)
        return {"token": text, "logprob": _floor(x), "bytes": list(text.encode("utf-8", "replace"))}

    content = []
    for entry in sample.logprobs or ():
        chosen, lp, _ = entry[0]
        content.append(item(chosen, lp) | {"top_logprobs": [item(t, x) for t, x, _rank in entry[1:]]})
    return {"content": content}


def _short(value: Any) -> str:
    if type(value) is int and value.bit_length() > 96:
        return f"an integer of {value.bit_length()} bits"  # never repr it: long ints convert in O(n^2)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRow("invalid_parameter", f"'{key}' must be a number, got {value!r}")
    return float(value)


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRow("invalid_parameter", "'stop' must be a non-empty string or a list of them")
    return tuple(stops)
