"""`LLM`: the front door a vLLM user expects, over `Engine` (the lower layer, unchanged).

    from specoffload import LLM, SamplingParams

    with LLM(model="~/models/target", draft="~/models/draft", device_memory="4GiB") as llm:
        for out in llm.generate(["def add(a, b):"], SamplingParams(max_tokens=32)):
            print(out.request_id, out.outputs[0].text, out.metrics.num_accepted_tokens)

`generate` returns vLLM-shaped `RequestOutput`s (runtime/outputs.py) in input order; `generate_iter` yields each
as its request finishes (prompts read lazily, one pipeline); `chat` runs conversations through the target's chat
template. `n` samples of a prompt are n rows of the engine, each with its own random stream: sample i of a
request seeded s draws from (s, i) alone, wherever the request sits in the batch (runtime/rng.py). One call runs at
a time (runtime/turns.py): calls from other threads wait their turn.
"""

from __future__ import annotations

import difflib
import itertools
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from .config import ConfigError, EngineConfig
from .engine import Engine, PromptError
from .offload.drafters import DRAFTERS, option_owners
from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .request import GenerationResult
from .sampling import SamplingParams, model_defaults
from .turns import Turn

logger = logging.getLogger(__name__)

PromptInput = str | Sequence[int] | Mapping[str, Any]
Message = Mapping[str, Any]

#: vLLM's names of engine options -> EngineConfig's
_VLLM_OPTIONS = {"max_num_seqs": "max_batch_size", "max_model_len": "max_seq_len",
                 "num_speculative_tokens": "num_draft_tokens", "speculative_model": "draft"}
#: vLLM options that change nothing on one device: accepted at these values (any value where the tuple is empty)
_VLLM_NO_OPS: dict[str, tuple[Any, ...]] = {
    "tensor_parallel_size": (1,), "pipeline_parallel_size": (1,), "data_parallel_size": (1,),
    "enforce_eager": (), "disable_log_stats": (), "trust_remote_code": (False,), "quantization": (None,),
    "disable_custom_all_reduce": (), "enable_prefix_caching": (False, None), "task": ("generate", "auto"),
}
#: vLLM options whose meaning differs here: refused, with what to use instead
_VLLM_INSTEAD = {
    "tensor_parallel_size": "one engine runs on one device; for several, run replicas on a Ray cluster "
                            "(`specoffload generate --backend ray --replicas N`)",
    "pipeline_parallel_size": "one engine runs on one device (replicas: --backend ray)",
    "data_parallel_size": "replicas run on a Ray cluster: `specoffload generate --backend ray --replicas N`",
    "gpu_memory_utilization": "give the budget itself: device_memory='12GiB' (the weights that do not fit stream)",
    "trust_remote_code": "this engine runs the model families it implements in its own code, never a "
                         "checkpoint's code",
    "quantization": "compress a checkpoint with `specoffload quantize --scheme int8|int4` and load that directory",
    "enable_prefix_caching": "there is no prefix cache yet",
    "task": "this engine generates text only",
    "max_num_batched_tokens": "prefill_chunk caps the prompt tokens one pass feeds",
    "swap_space": "host_memory bounds the host side (KV cache and the 'ram' weights tier)",
    "cpu_offload_gb": "device_memory is the budget; everything beyond it streams from host memory or disk",
}
#: speculative_config's "method" names that are vLLM's, not our drafters' (every registered drafter's own name is one
#: too: "ngram", "suffix", "self", "lowbit", ...; a "model" key alone means a draft model)
_VLLM_METHODS = {"draft_model": "model"}


def _spec_methods() -> dict[str, str]:
    """speculative_config's "method" -> our drafter: vLLM's names, and every registered drafter that proposes."""
    return _VLLM_METHODS | {name: name for name, cls in DRAFTERS.items() if cls.proposes and name != "model"}


class LLM:
    """Offline generation with a target model, speculating with `draft` (a checkpoint directory, "self", or None).

    model: the target checkpoint directory ("~" expanded). device_memory: a budget ("4GiB") that turns on
    offloading (the planner then picks batch and k unless given). dtype: "auto" (default: the checkpoint's; on the
    CPU a float16 checkpoint computes in float32), "float32", "bfloat16" or "float16". seed: the random stream of
    requests whose SamplingParams have none. Other keywords are EngineConfig's (runtime/config.py), or vLLM's
    names for them: max_num_seqs (max_batch_size), max_model_len (max_seq_len), num_speculative_tokens
    (num_draft_tokens), speculative_model (draft); a drafter's option (prompt_lookup_max=4) goes into
    drafter_options. vLLM's `speculative_config` dict ({"method": "ngram" | "suffix" | "draft_model" | "self" |
    "lowbit" (any registered drafter's name),
    "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", ...}) sets the drafter; settings
    that change nothing on one device (tensor_parallel_size=1, enforce_eager, ...) are accepted, those that would
    are refused in one line saying what to use; an unknown keyword names the closest known one.
    """

    def __init__(self, model: str | Path, draft: str | Path | None = None, *, device_memory: int | str | None = None,
                 dtype: str = "auto", seed: int | None = None, **options: Any) -> None:
        draft = _vllm_settings(options, draft)
        for vllm_name, ours in _VLLM_OPTIONS.items():
            if vllm_name in options:
                value = options.pop(vllm_name)
                if ours in options and options[ours] != value:
                    raise ConfigError(f"{vllm_name} and {ours} name the same option: give one of them")
                if ours == "draft":
                    if draft is not None and draft != value:
                        raise ConfigError("speculative_model and draft name the same option: give one of them")
                    draft = value
                else:
                    options[ours] = value
        named = option_owners()  # a drafter's option as a keyword (prompt_lookup_max=4): into drafter_options
        given = {key: options.pop(key) for key in list(options) if key in named}
        if given:
            options["drafter_options"] = {**options.get("drafter_options", {}), **given}
        unknown = [key for key in options if key not in _CONFIG_FIELDS]
        if unknown:  # one line, with the closest name this engine knows
            close = difflib.get_close_matches(unknown[0], [*_CONFIG_FIELDS, *_VLLM_OPTIONS, *named], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"LLM: unexpected keyword {unknown[0]!r}{hint}")
        config = EngineConfig(target=model, draft=draft, device_memory=device_memory, dtype=dtype, **options)
        self.engine = Engine(config)
        self._turn = Turn("LLM")  # one call at a time (runtime/turns.py): other threads wait their turn
        self.seed = seed
        self._ids = itertools.count()

    # ---- vLLM's accessors ---------------------------------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling_params runs, as in vLLM: the target's generation_config.json (its
        temperature, top_p, top_k, repetition_penalty and max_new_tokens; `do_sample: false` is greedy, as in
        transformers) over vLLM's SamplingParams defaults (temperature 1.0, 16 tokens): sampling.py
        `model_defaults`."""
        return SamplingParams(**model_defaults(self.config.target)[0])

    # ---- generation ---------------------------------------------------------------------------------------------
    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt (a string, token ids, {"prompt": ...} or {"prompt_token_ids": [...]}, or a list
        of them); one RequestOutput per prompt, in input order. use_tqdm (vLLM's, default on): a progress bar on
        stderr with the committed tokens per second."""
        with self._turn("generate"):
            items = _prompt_list(prompts)
            return self._run([(text, ids) for text, ids in (self._prompt(i, p) for i, p in enumerate(items))],
                             sampling_params, use_tqdm)

    def generate_iter(self, prompts: Iterable[PromptInput],
                      sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield each prompt's RequestOutput as its last sample finishes (finish order), reading prompts lazily:
        an iterator of prompts streams through one pipeline. (Whole requests, not tokens, are what streams.)"""
        params = _checked(sampling_params or self.get_default_sampling_params())
        pending: dict[int, dict[int, GenerationResult]] = {}
        info: dict[int, tuple[str, str | None, list[int]]] = {}

        def engine_rows() -> Iterator[tuple[Any, SamplingParams, int | str]]:
            for i, prompt in enumerate(prompts):
                text, ids = self._prompt(i, prompt)
                info[i] = (str(next(self._ids)), text, ids)
                for key in self._keys(i, params):
                    yield ids, self._row_params(params), key

        index = []  # engine row -> (request, sample)
        with self._turn("generate_iter"):  # from the first output asked for until exhausted or closed
            for r in self.engine.stream(_recording(engine_rows(), index, params.n)):
                request, sample = index[r.index]
                done = pending.setdefault(request, {})
                done[sample] = r
                if len(done) == params.n:
                    request_id, text, ids = info.pop(request)
                    yield self._output(request_id, text, ids, [done[s] for s in range(params.n)])
                    del pending[request]

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *, use_tqdm: bool = True,
             chat_template_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """Complete one conversation (a list of {"role", "content"} messages) or a list of them, each through the
        target's chat template with the assistant's turn opened; one RequestOutput per conversation."""
        with self._turn("chat"):
            return self._chat(messages, sampling_params, use_tqdm, chat_template_kwargs)

    def _chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
              sampling_params: SamplingParams | Sequence[SamplingParams] | None, use_tqdm: bool,
              chat_template_kwargs: Mapping[str, Any] | None) -> list[RequestOutput]:
        conversations = _conversations(messages)
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise PromptError(f"{self.config.target} has no chat template: use generate() with text or token ids")
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                text = tok.apply_chat_template(list(conversation), tokenize=False, add_generation_prompt=True,
                                               **dict(chat_template_kwargs or {}))
            except Exception as err:  # noqa: BLE001 - a template may raise anything (jinja)
                raise PromptError(f"conversation {i}: the chat template refused it: {err}") from None
            prompts.append((text, self.engine.encode(tok.encode(text, add_special_tokens=False), i)))
        return self._run(prompts, sampling_params, use_tqdm)

    # ---- lifetime -----------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Release the engine's workers (threads, files, shared memory); the LLM is unusable afterwards."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- internals ----------------------------------------------------------------------------------------------
    def _row_params(self, p: SamplingParams) -> SamplingParams:
        """A sampled request without a seed of its own draws from the LLM's seed (if it has one)."""
        return replace(p, seed=self.seed) if p.seed is None and self.seed is not None and not p.greedy else p

    def _keys(self, i: int, p: SamplingParams) -> list[int | str]:
        """Each sample's random-stream key: a request with its own seed draws from (seed, sample) alone, so it comes
        out the same wherever it sits; otherwise (LLM seed or none, prompt index, sample); sample 0 of prompt i
        is keyed i, as Engine.generate keys it."""
        if p.seed is not None:
            return list(range(p.n))
        return [i if s == 0 else f"{i}:{s}" for s in range(p.n)]

    def _run(self, prompts: list[tuple[str | None, list[int]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None, use_tqdm: bool) -> list[RequestOutput]:
        if not prompts:
            raise PromptError("the prompt list is empty: nothing to generate")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            per_prompt = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            per_prompt = list(sampling_params)
            if len(per_prompt) != len(prompts):
                raise ValueError(f"sampling_params: one SamplingParams, or one per prompt ({len(prompts)}); "
                                 f"got {len(per_prompt)}")
        per_prompt = [_checked(p) for p in per_prompt]
        ids, params, keys, owner = [], [], [], []
        for i, ((_, prompt_ids), p) in enumerate(zip(prompts, per_prompt)):
            for s, key in enumerate(self._keys(i, p)):
                ids.append(prompt_ids)
                params.append(self._row_params(p))
                keys.append(key)
                owner.append((i, s))
        results = self.engine.generate(ids, params, progress=use_tqdm, keys=keys)
        grouped: list[list[GenerationResult]] = [[] for _ in prompts]
        for (i, _), r in zip(owner, results):
            grouped[i].append(r)
        return [self._output(str(next(self._ids)), text, prompt_ids, grouped[i])
                for i, (text, prompt_ids) in enumerate(prompts)]

    def _prompt(self, i: int, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt, checked by the engine (PromptError names prompt i)."""
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self.engine.encode(prompt["prompt_token_ids"], i)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise PromptError(f"prompt {i}: a dict prompt needs 'prompt' or 'prompt_token_ids'; for messages "
                                  "use LLM.chat")
        if isinstance(prompt, str):
            return prompt, self.engine.encode(prompt, i)
        if isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
            raise PromptError(f"prompt {i} is a list of messages: use LLM.chat(messages) for conversations")
        return None, self.engine.encode(prompt, i)

    def _output(self, request_id: str, text: str | None, prompt_ids: list[int],
                samples: list[GenerationResult]) -> RequestOutput:
        tok = self.engine.tokenizer
        outputs = []
        for s, r in enumerate(samples):
            logprobs = None
            if r.logprobs is not None:
                logprobs = []
                for entry in r.logprobs:  # the chosen token first, then the top-N (vLLM's order)
                    by_id: dict[int, Logprob] = {}
                    for t, x, rank in entry:
                        by_id.setdefault(t, Logprob(x, rank, tok.decode([t]) if tok is not None else None))
                    logprobs.append(by_id)
            outputs.append(CompletionOutput(s, r.text if r.text is not None else "", list(r.token_ids),
                                            r.cumulative_logprob, logprobs, r.finish_reason, r.stop_reason,
                                            r.num_drafted, r.num_accepted))
        first = samples[0]
        metrics = RequestMetrics(
            time_to_first_token=first.time_to_first_token_s, time=max((r.time_s or 0.0) for r in samples),
            num_prompt_tokens=len(prompt_ids), num_generated_tokens=sum(len(r.token_ids) for r in samples),
            num_drafted_tokens=sum(r.num_drafted for r in samples),
            num_accepted_tokens=sum(r.num_accepted for r in samples))
        return RequestOutput(request_id, text, list(prompt_ids), outputs, True, metrics)


_CONFIG_FIELDS = frozenset(f.name for f in fields(EngineConfig)) - {"target"}


def _vllm_settings(options: dict[str, Any], draft: str | Path | None) -> str | Path | None:
    """Take vLLM's engine settings out of `options` (in place): those that change nothing on one device are
    dropped, those whose meaning differs refused in one line saying what to use instead, and `speculative_config`
    ({"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", ...}) turned into
    the drafter, its options and k. Returns the draft checkpoint (the argument, or speculative_config's model)."""
    for name, allowed in _VLLM_NO_OPS.items():
        if name in options and (not allowed or options[name] in allowed):
            options.pop(name)
    for name, instead in _VLLM_INSTEAD.items():
        if name in options:
            raise ConfigError(f"LLM: {name}={options[name]!r} is not supported here: {instead}")
    spec = options.pop("speculative_config", None)
    if spec is None:
        return draft
    if not isinstance(spec, Mapping):
        raise ConfigError(f"LLM: speculative_config must be a dict (vLLM's), got {type(spec).__name__}")
    spec = dict(spec)
    method = spec.pop("method", None)
    spec_model = spec.pop("model", None)
    if method is None:
        method = "draft_model" if spec_model is not None else None
    methods = _spec_methods()
    if method not in methods:
        raise ConfigError(f"LLM: speculative_config method {method!r} is not supported here; use one of "
                          f"{sorted(methods)} (a 'model' with no method is a draft model)")
    drafter = methods[method]
    if drafter == "model":
        if spec_model is None:
            raise ConfigError("LLM: speculative_config method 'draft_model' needs its 'model' (a checkpoint directory)")
        if draft is not None and draft != spec_model:
            raise ConfigError("LLM: draft and speculative_config's model name the same option: give one of them")
        draft = spec_model
    elif spec_model is not None:
        raise ConfigError(f"LLM: speculative_config method {method!r} takes no 'model'")
    if "drafter" in options and options["drafter"] != drafter:
        raise ConfigError(f"LLM: drafter={options['drafter']!r} and speculative_config's method {method!r}: give one")
    options["drafter"] = drafter
    if "num_speculative_tokens" in spec:
        options["num_speculative_tokens"] = spec.pop("num_speculative_tokens")
    named = option_owners()
    for key in [key for key in spec if key in named]:  # a drafter's option: a keyword, as LLM(prompt_lookup_max=4)
        options.setdefault(key, spec.pop(key))  # (a keyword given beside it wins, as over drafter_options)
    if spec:
        raise ConfigError(f"LLM: speculative_config key {next(iter(spec))!r} is not supported here (known: method, "
                          f"model, num_speculative_tokens, {', '.join(sorted(named))})")
    return draft


def _checked(p: Any) -> SamplingParams:
    if not isinstance(p, SamplingParams):
        raise ValueError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
    return p


def _recording(rows: Iterator[tuple[Any, SamplingParams, int | str]], index: list[tuple[int, int]],
               n: int) -> Iterator[tuple[Any, SamplingParams, int | str]]:
    """Pass rows through, noting each engine row's (request, sample): rows come n per request, in order."""
    for row_number, row in enumerate(rows):
        index.append((row_number // n, row_number % n))
        yield row


def _prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompts):
        return [prompts]  # one prompt of token ids
    if not isinstance(prompts, Sequence):
        raise PromptError("prompts must be a string, token ids, or a list of them")
    return list(prompts)


def _conversations(messages: Sequence[Message] | Sequence[Sequence[Message]]) -> list[Sequence[Message]]:
    if isinstance(messages, Sequence) and messages and all(isinstance(m, Mapping) for m in messages):
        return [messages]  # one conversation
    if (isinstance(messages, Sequence) and messages
            and all(isinstance(c, Sequence) and c and all(isinstance(m, Mapping) for m in c) for c in messages)):
        return list(messages)
    raise PromptError("messages must be a conversation (a list of {'role', 'content'} dicts) or a list of them")


__all__ = ["LLM"]
