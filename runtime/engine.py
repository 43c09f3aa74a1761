"""The in-process engine: continuous batching around a lossless speculative step."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from .config import EngineConfig
from .kv_cache import KVCache
from .models.errors import SpecOffloadError
from .models.model import Transformer
from .request import GenerationResult, Request
from .sampling import SamplingParams
from .speculative import SpeculativeStep, StepTimes, pad_right
from .tokenizer import load_tokenizer

Prompt = str | Sequence[int]


class PromptError(SpecOffloadError, ValueError):
    """A prompt the engine cannot run (empty, too long, out-of-vocabulary ids, ...)."""


class VocabularyMismatchError(SpecOffloadError):
    """Draft and target do not share a vocabulary."""


@dataclass(frozen=True)
class GenerateStats:
    """Totals for one `generate` call."""

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


class Engine:
    """Generates completions with the target model, optionally speculating with a draft model.

    Greedy output equals the target's own greedy decoding; sampled output follows the target's
    (warped) distribution exactly (see `verify.verify_sampling`).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        dtype, device = config.torch_dtype, config.device
        self.target = Transformer(config.target, dtype=dtype, device=device)
        self.draft = Transformer(config.draft, dtype=dtype, device=device) if config.draft else None
        self.tokenizer = load_tokenizer(config.target)
        if self.draft is not None:
            self._check_vocabularies()
        # Everything is resident in the in-process engine: load now, not inside the first timed step.
        for model in (self.target, self.draft):
            if model is not None:
                model.preload()
        self.last_stats: GenerateStats | None = None

    # ---- validation -------------------------------------------------------------------------
    def _check_vocabularies(self) -> None:
        assert self.draft is not None
        t, d = self.target.config.vocab_size, self.draft.config.vocab_size
        problem = None
        if t != d:
            problem = f"vocab_size {t} (target) != {d} (draft)"
        else:
            draft_tok = load_tokenizer(self.config.draft)
            both = self.tokenizer is not None and draft_tok is not None
            if both and self.tokenizer.get_vocab() != draft_tok.get_vocab():
                problem = "their tokenizers map tokens to different ids"
        if problem:
            raise VocabularyMismatchError(
                f"draft model {self.config.draft} and target model {self.config.target} do not share a "
                f"vocabulary: {problem}. Speculative decoding needs a draft on the target's vocabulary."
            )

    def _encode(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise PromptError("prompts must be a list of strings or of token-id lists")
        if len(prompts) == 0:
            raise PromptError("the prompt list is empty: nothing to generate")
        vocab = self.target.config.vocab_size
        context = self.target.config.max_position_embeddings
        encoded: list[list[int]] = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise PromptError(
                        f"prompt {i} is text but {self.config.target} has no tokenizer; pass token ids"
                    )
                ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            else:
                ids = [int(t) for t in prompt]
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    raise PromptError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
            if not ids:
                raise PromptError(f"prompt {i} is empty")
            if len(ids) >= context:
                raise PromptError(
                    f"prompt {i} has {len(ids)} tokens; the target's context is {context} tokens "
                    "(the prompt must leave room for at least one new token)"
                )
            encoded.append(ids)
        return encoded

    # ---- generation -------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams | None = None, progress: bool = False
    ) -> list[GenerationResult]:
        """Complete every prompt; results come back in input order."""
        params = params or SamplingParams()
        encoded = self._encode(prompts)
        with torch.inference_mode():
            return self._generate(encoded, params, progress)

    def _generate(self, encoded: list[list[int]], params: SamplingParams, progress: bool) -> list[GenerationResult]:
        start = time.perf_counter()
        cfg = self.target.config
        k = self.config.num_draft_tokens if self.draft is not None else 0
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(cfg.eos_token_ids)
        )
        context = cfg.max_position_embeddings
        requests = [
            Request(i, ids, min(params.max_new_tokens, context - len(ids)), stop_ids)
            for i, ids in enumerate(encoded)
        ]
        # Room for the longest prompt, its output, and the k + 1 speculative positions of a step.
        capacity = max(len(r.prompt) + r.max_new_tokens for r in requests) + k + 1
        rows = min(self.config.max_batch_size, len(requests))
        t_cache = self.target.new_cache(rows, capacity)
        d_cache = self.draft.new_cache(rows, capacity) if self.draft is not None else None
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        step = SpeculativeStep(self.target, self.draft, params, generator)
        times = StepTimes()
        waiting = deque(requests)
        slots: list[Request | None] = [None] * rows
        bar = tqdm(total=len(requests), desc="generate", unit="prompt", disable=not progress)
        prefill_s = 0.0
        steps = 0
        while True:
            t0 = time.perf_counter()
            self._admit(waiting, slots, t_cache, d_cache)
            prefill_s += time.perf_counter() - t0
            if not waiting and any(s is None for s in slots):
                keep = [i for i, s in enumerate(slots) if s is not None]
                if not keep:
                    break
                t_cache.select_rows(keep)
                if d_cache is not None:
                    d_cache.select_rows(keep)
                slots = [slots[i] for i in keep]
            active: list[Request] = [s for s in slots if s is not None]
            # Never draft past the longest remaining budget: k may change from step to step.
            k_step = min(k, max(r.remaining for r in active) - 1)
            self._step(step, active, t_cache, d_cache, k_step, times)
            steps += 1
            for i, r in enumerate(slots):
                if r is not None and r.finished:
                    slots[i] = None
                    bar.update(1)
        bar.close()
        results = [self._result(r) for r in requests]
        self.last_stats = GenerateStats(
            num_prompts=len(requests),
            prompt_tokens=sum(len(r.prompt) for r in requests),
            generated_tokens=sum(len(r.output) for r in requests),
            num_drafted=sum(r.num_drafted for r in requests),
            num_accepted=sum(r.num_accepted for r in requests),
            steps=steps,
            wall_s=time.perf_counter() - start,
            prefill_s=prefill_s,
            draft_s=times.draft,
            target_s=times.target,
            verify_s=times.verify,
        )
        return results

    def _admit(self, waiting: deque[Request], slots: list[Request | None], t_cache: KVCache,
               d_cache: KVCache | None) -> None:
        """Fill free slots from the queue and prefill the new rows (all but their last prompt token)."""
        free = [i for i, s in enumerate(slots) if s is None]
        new = [(i, waiting.popleft()) for i in free[: len(waiting)]]
        if not new:
            return
        for i, r in new:
            slots[i] = r
        rows = [i for i, _ in new]
        prefixes = [r.prompt[:-1] for _, r in new]
        for model, cache in ((self.target, t_cache), (self.draft, d_cache)):
            if model is None or cache is None:
                continue
            cache.reset_rows(rows)
            if max(len(p) for p in prefixes) == 0:
                continue
            ids, num_new = pad_right(prefixes)  # rows with a one-token prompt have num_new 0
            tmp = model.new_cache(len(rows), ids.shape[1])
            model.forward(ids, tmp, num_new=num_new, output_positions=None, compute_logits=False)
            cache.assign_rows(rows, tmp)

    def _step(self, step: SpeculativeStep, active: list[Request], t_cache: KVCache, d_cache: KVCache | None,
              k: int, times: StepTimes) -> None:
        committed = [r.num_tokens for r in active]
        t0 = time.perf_counter()
        draft_tokens = torch.zeros((len(active), 0), dtype=torch.long)  # [batch, k]
        p = None
        if k >= 1 and d_cache is not None:
            d_len = d_cache.lengths.tolist()
            unfed = [r.tokens[d_len[b]:] for b, r in enumerate(active)]
            draft_tokens, p = step.propose(d_cache, unfed, k)
        t1 = time.perf_counter()
        pending = torch.tensor([r.tokens[-1] for r in active], dtype=torch.long)  # [batch]
        result = step.verify(t_cache, pending, draft_tokens, p)
        t2 = time.perf_counter()
        accepted = result.num_accepted.tolist()
        emitted = result.tokens.tolist()
        for b, r in enumerate(active):
            n = accepted[b]
            r.num_drafted += k
            r.num_accepted += n
            r.commit(emitted[b][: n + 1])
        # Target cache: keep pending + the n accepted drafts (the new last token is pending).
        t_cache.truncate(torch.tensor([c + n for c, n in zip(committed, accepted)], dtype=torch.long))
        if d_cache is not None and k >= 1:
            # Draft cache saw committed + d_1..d_{k-1}; keep what the target accepted.
            d_cache.truncate(torch.tensor([c + min(n, k - 1) for c, n in zip(committed, accepted)],
                                          dtype=torch.long))
        t3 = time.perf_counter()
        times.draft += t1 - t0
        times.target += t2 - t1
        times.verify += t3 - t2

    def _result(self, r: Request) -> GenerationResult:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(r.output, skip_special_tokens=True)
        return GenerationResult(
            index=r.index,
            prompt_token_ids=r.prompt,
            token_ids=r.output,
            text=text,
            finish_reason=r.finish_reason or "length",
            num_drafted=r.num_drafted,
            num_accepted=r.num_accepted,
        )

