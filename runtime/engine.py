"""`Engine`: the one front door, over one runner: the pipeline (runtime/offload/pipeline.py). With `device_memory` set
the target streams the weights the placement does not keep; without it every part is resident and nothing streams.

The life of a request, top-down:
  1. `Engine(config)` reads the checkpoints' headers (nothing is loaded yet), checks that the draft shares the
     target's vocabulary, and makes the `Plan` (runtime/planning.py: batch, k, k_max, KV length per row; the
     planner's search when the config says "auto"). Offloaded, it places every part and cache under the budget
     (planner/placement.py); resident, every part is resident. It builds the workers (`workers`: in this process
     by default, or role actors from actors/) and the drafter the plan asks for (offload/drafters.py).
  2. `generate(prompts)` encodes and checks the prompts, turns them into `Request`s, and hands them to the
     `Pipeline`, which verifies drafts losslessly (runtime/verify.py): greedy output equals the target's own,
     token for token. An engine that planned without a job plans again for this one first (`_plan_job`), and a
     running job whose passes find the profile off may be re-placed once (`propose` / `adopt`: the pipeline's
     `Replacer`).
  3. Results come back in input order, with per-request acceptance counts; `last_stats` holds the totals.

Which file to touch: a new drafter is a class in offload/drafters.py and one `register_drafter` line; a new model
family is runtime/models/ (config.py, checkpoint names in weights.py, layers.py); a new backend is a
`WorkerFactory` and a `Recovery` (offload/workers.py, offload/pipeline.py) registered as a CLI backend
(runtime/backends.py).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence

import torch

from specoffload.planner import HardwareProfile, Workload
from specoffload.planner.cost import estimate_step
from specoffload.planner.errors import SpecOffloadError
from specoffload.planner.experts import selects_experts
from specoffload.planner.placement import Placement
from specoffload.planner.plan import Plan

from .bounded_encode import TooLong, encode_bounded
from .config import ConfigError, EngineConfig
from .models.linear import bound_kernel_caches
from .models.model import Transformer
from .offload.batches import PromptBudget
from .offload.pipeline import Adopted, Pipeline, Recovery
from .offload.profiler import load_or_measure, mark_stale
from .offload.replan import Replanner
from .offload.workers import WeightPlan, WorkerFactory, Workers, local_workers
from .planning import (
    ModelPair,
    make_plan,
    place_plan,
    plan_minimum_device_memory,
    replacement,
    resolve_max_seq_len,
)
from .request import Feed, GenerationResult, MappedFeed, Request
from .rng import row_seed
from .sampling import SamplingParams
from .stats import GenerateStats, OffloadStats
from .tokenizer import load_tokenizer
from .trace import Tracer
from .turns import Turn

Prompt = str | Sequence[int]

logger = logging.getLogger("specoffload.engine")


class PromptError(SpecOffloadError, ValueError):
    """A prompt the engine cannot run (empty, too long, out-of-vocabulary ids, ...)."""


class VocabularyMismatchError(SpecOffloadError):
    """Draft and target do not share a vocabulary."""


#: the most exact mode multiplied a pass's compute in docs/perf `exact_cost` (the 1.5B resident: 1.4-2.2x per
#: repetition); exact="auto" turns it on where the pass's reads take at least this many times its compute
EXACT_COMPUTE = 2.2


class Engine:
    """Generates completions with the target model, speculating with a drafter when the plan says so.

    workers: how an offloaded engine builds its workers (default: in this process); recovery: what it does
    when one is lost mid-generation (default: nothing, the error propagates). Both are for backends (actors/).
    plan: a ready plan (e.g. from `specoffload plan`); default: made from the config. profile: the hardware profile
    (offload/profiler.py), to plan with and to check the passes against (offload/replan.py `check_profile`), also
    under a fixed plan; default: the cached one when the config is planned, else none.
    One call runs at a time (runtime/turns.py): `generate` and `stream` from other threads wait their turn.
    """

    def __init__(self, config: EngineConfig, *, workers: WorkerFactory | None = None,
                 recovery: Recovery | None = None, plan: Plan | None = None,
                 profile: HardwareProfile | None = None) -> None:
        self.config = config
        bound_kernel_caches()  # a long job's ragged batches would fill oneDNN's kernel caches (models/linear.py)
        if torch.device(config.device).type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {config.device!r}: this torch ({torch.__version__}) sees no CUDA GPU; "
                              "use device='cpu'")
        if config.host_attention and config.drafter_class.shares_target:
            raise ConfigError(f"drafter {config.drafter_name!r} drafts with the target's own attention and KV cache, "
                              "which stay on the CPU beside a GPU: it runs offloaded on device 'cpu' only so far; on "
                              "CUDA use a draft model or a model-free drafter")
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        dtype = config.torch_dtype
        self.target = Transformer(config.target, dtype=dtype, device=config.device,
                                  packed=config.packed_resident)  # headers only: nothing loaded
        self.tokenizer = load_tokenizer(config.target)
        cfg = self.target.config
        drafter = config.drafter_class  # the registry's class (offload/drafters.py): ask it, not the name
        if drafter.needs_moe_target and not cfg.num_experts:
            raise ConfigError(f"drafter {config.drafter_name!r} needs an MoE target; {config.target} is dense "
                              "(no routed experts)")
        draft_model = None
        if drafter.needs_checkpoint:  # a model of its own: it must share the target's vocabulary
            draft_model = Transformer(config.draft, dtype=config.draft_torch_dtype, device=config.device)
            self._check_vocabularies(draft_model)
        # in this process a drafter that shares the target drafts with its parts and KV cache (no second cache); a
        # backend's drafter lives in another process and keeps its own
        self.models = ModelPair.for_config(config, self.target, shares_kv=workers is None)
        resident_context = None if config.offloaded else cfg.max_position_embeddings  # the resident KV grows
        max_seq_len = resolve_max_seq_len(config.max_seq_len or resident_context, cfg.max_position_embeddings)
        # the planner's profile: for the plan, and for re-planning online a plan the planner made (also one given)
        self.profile = profile if profile is not None else (
            load_or_measure(config, open_engine=Engine) if config.planned else None)
        blind = plan is None  # planned here, for no job in particular (`_plan_job`)
        if plan is None:
            plan = make_plan(config, self.models, max_seq_len, profile=self.profile)
        self.tracer = Tracer(enabled=config.trace)
        self._turn = Turn("Engine")
        self._profile_marked = False
        self.last_stats: GenerateStats | None = None
        self.placement: Placement | None = None
        self.workers: Workers | None = None
        self._place(plan)  # PlacementError (with the minimum) if the budget is too small
        if config.exact == "auto":
            config = self.config = dataclasses.replace(config, exact=self._exact_is_hidden(plan))
        self.target.exact = config.exact  # (as the workers' models compute)
        self.workers = (workers or local_workers)(config, self.weight_plan, plan)
        # re-placement of a running job (offload/pipeline.py, step 6): local workers, a planned batch
        replaces = workers is None and config.offloaded and config.max_batch_size == "auto" and plan.policy is not None
        #: the plan made here without a job (re-planned for each job, `_plan_job`); its max_seq_len bounds prompts
        self._blind: Plan | None = plan if replaces and blind else None
        self._job: tuple[Workload, int] | None = None  # the last job `_plan_job` planned for
        self.pipeline = Pipeline(plan, self.weight_plan, cfg.num_layers, self.workers, self.replanner, self.tracer,
                                 recovery, config.num_threads,
                                 adapt_interval=drafter.adapt_interval(config),
                                 refill=config.refill, prompts=self._prompts(plan),
                                 replacer=self if replaces else None)

    # ---- construction -----------------------------------------------------------------------------------------------
    def _place(self, plan: Plan) -> None:
        """`plan`'s placement (offloaded), weight plan and replanner, at construction and at a re-placement."""
        cfg, config = self.target.config, self.config
        self.plan = plan
        if config.offloaded:
            self.placement = place_plan(config, plan, self.models)
            self.weight_plan = WeightPlan.from_placement(self.placement, cfg.num_layers, cfg.num_experts,
                                                         self._select_experts(), plan.draft_experts)
        else:  # nothing streams: the same pipeline, every part resident where compute runs
            self.weight_plan = WeightPlan.all_resident(self.models.target, config.num_buffers)
        self.replanner = Replanner(plan, config.replan_interval, self.profile, self.models.costs(plan.drafting),
                                   self.placement, config.expert_loading, refill=config.refill,
                                   full_feed=not config.drafter_class.model_free)

    def _prompts(self, plan: Plan) -> PromptBudget:
        return PromptBudget(pace=plan.prefill_chunk, cap=self.config.prefill_chunk)

    def _exact_is_hidden(self, plan: Plan) -> bool:
        """exact="auto": on where the planned decode pass waits on its reads long enough to hide exact mode's extra
        compute (predicted t_io >= EXACT_COMPUTE x t_compute, planner/cost.py `estimate_step`), so that it costs
        nothing; off resident, and without a profile to predict from."""
        if not self.config.offloaded or self.profile is None or self.placement is None:
            return False
        step = estimate_step(self.profile, self.models.costs(plan.drafting), self.placement, plan.batch, plan.k,
                             self.config.acceptance_prior, plan.max_seq_len // 2, self.config.expert_loading,
                             plan.interleave)
        return step.t_io >= EXACT_COMPUTE * step.t_compute

    def _check_vocabularies(self, draft: Transformer) -> None:
        t, d = self.target.config.vocab_size, draft.config.vocab_size
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

    def _select_experts(self) -> bool:
        """MoE: load only the experts the router picks for the pass (planner/experts.py)."""
        cfg = self.target.config
        assert self.placement is not None
        return selects_experts(self.placement, self.config.expert_loading, cfg.num_experts, cfg.num_experts_per_tok,
                               self.plan.batch * (self.plan.k + 1))

    # ---- re-placement (offload/pipeline.py, step 6: the pipeline's `Replacer`) -------------------------------------
    def propose(self, rows_left: int, tokens_left: float, refeed_tokens: int) -> Plan | None:
        """The planner's best plan for what the running job has left, on the profile its passes corrected
        (planning.py `replacement`), when moving to it pays; one line says what was weighed either way."""
        r = self.replanner
        profile = r.calibrated_profile()
        if profile is None or rows_left < 1:
            return None
        prompt_len = max(1.0, r.prompt_len or self.plan.max_seq_len / 2)
        new_tokens = max(1, r.tokens_per_row or self.plan.max_seq_len - round(prompt_len))
        workload = Workload(num_prompts=rows_left, prompt_len=prompt_len, new_tokens=new_tokens)
        alpha = r.tracker.curve() if self.plan.drafting else None
        choice = replacement(self.config, self.models, self.plan, r.k, profile, workload, tokens_left,
                             refeed_tokens, alpha)
        if choice is None:
            return None
        weighed = (f"{choice.plan.describe()} is predicted at {choice.tokens_per_s:.3g} tokens/s against "
                   f"{choice.current_tokens_per_s:.3g} for the running plan ({self.plan.describe()}), for "
                   f"{rows_left} rows and {tokens_left:.0f} new tokens left; the switch costs ~{choice.switch_s:.2g} s")
        if not choice.pays:
            logger.info("re-placement does not pay: %s", weighed)
            return None
        logger.warning("re-placing the running job: %s", weighed)
        return choice.plan

    def _plan_job(self, requests: Sequence[Request]) -> None:
        """An engine that planned without a job (`Engine(config)`, e.g. under `LLM`) plans again for the job it is
        given (item 1 of the planner's rules: no KV for rows the job does not have): its rows, prompt lengths and
        new tokens, KV for its longest row (unless the config fixes max_seq_len), on the profile as corrected so
        far; it moves to that plan when `replacement` says it pays (nothing runs yet: no row is fed again), and
        always when the job's rows are longer than the current plan holds (an earlier job's plan; then with KV for
        at least twice the rows' tokens it held)."""
        if self._blind is None or not requests:
            return
        need = max(len(r.prompt) + r.max_new_tokens for r in requests)
        max_seq_len = self._blind.max_seq_len if self.config.max_seq_len is not None else need
        workload = Workload.of_prompts([len(r.prompt) for r in requests], max(r.max_new_tokens for r in requests))
        job = (workload, max_seq_len)
        if job == self._job and need <= self.plan.max_seq_len:
            return  # (the same job as the last one: it was planned)
        self._job = job
        profile = self.replanner.calibrated_profile() or self.profile
        assert profile is not None
        alpha = self.replanner.tracker.curve() if self.plan.drafting else None
        if need > self.plan.max_seq_len:  # (KV at least doubled: a run of ever longer jobs re-plans log2 times)
            if self.config.max_seq_len is None:
                max_seq_len = min(self._blind.max_seq_len, max(need, 2 * self.plan.max_seq_len))
            plan = make_plan(self.config, self.models, max_seq_len, workload=workload, alpha=alpha, profile=profile,
                             compare_no_draft=False)
        else:
            choice = replacement(self.config, self.models, self.plan, self.replanner.k, profile, workload,
                                 float(sum(r.max_new_tokens for r in requests)), 0, alpha, max_seq_len=max_seq_len)
            if choice is None or not choice.pays:
                return
            plan = choice.plan
        logger.info("planned for this job (%d prompts, rows up to %d tokens): %s (was %s)", len(requests), need,
                    plan.describe(), self.plan.describe())
        self._switch(plan)

    def _switch(self, plan: Plan) -> None:
        """Between runs: the workers rebuilt under `plan`, and the pipeline runs with them."""
        self.pipeline.adopt(self.adopt(plan))

    def adopt(self, plan: Plan) -> Adopted:
        """Release the workers and build `plan`'s (its placement, weight plan and replanner, which carries what
        the running one learnt: acceptance, the profile's correction); the pipeline runs on with them."""
        assert self.workers is not None and self.placement is not None
        self.workers.close()  # (first: the budget holds one placement's weights and caches at a time)
        self.workers = None
        self.pipeline.drop_workers()
        gc.collect()  # (their tensors go before the new ones are made)
        previous = self.replanner
        self._place(plan)
        self.replanner.carry(previous)
        self.workers = local_workers(self.config, self.weight_plan, plan)
        return Adopted(plan, self.weight_plan, self.workers, self.replanner, self._prompts(plan))

    # ---- what it decided --------------------------------------------------------------------------------------------
    @property
    def max_seq_len(self) -> int:
        """Prompt + output tokens a row may have (a job's plan may hold fewer: `_plan_job` sizes it to the job)."""
        return (self._blind or self.plan).max_seq_len

    def describe_placement(self) -> str:
        """The placement table (offloaded), or a line saying every weight is resident."""
        return self.placement.table() if self.placement is not None else "every weight resident (no device_memory)"

    def minimum_device_memory(self) -> int:
        """The smallest device_memory that places this model pair under the current plan."""
        return plan_minimum_device_memory(self.config, self.plan, self.models)

    # ---- generation -------------------------------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False, keys: Sequence[int | str] | None = None,
    ) -> list[GenerationResult]:
        """Complete every prompt; results come back in input order.

        params: one SamplingParams for every prompt, or one per prompt; every row runs at its own parameters in
        one batch (its warping, length, stop ids and random stream are its own).
        keys: each prompt's identity for its random stream (default: its index in `prompts`): a sampled row draws
        from (its params' seed, its key) alone (runtime/rng.py), so it comes out the same whatever else runs.
        """
        with self._turn("generate"):
            encoded = self._encode(prompts)
            per_row = _per_row(params, len(encoded))
            if keys is not None and len(keys) != len(encoded):
                raise ValueError(f"keys: one per prompt ({len(encoded)}); got {len(keys)}")
            requests = [self._request(i, ids, p, i if keys is None else keys[i])
                        for i, (ids, p) in enumerate(zip(encoded, per_row))]
            self._plan_job(requests)
            self.replanner.prompt_len = sum(len(r.prompt) for r in requests) / len(requests)
            with torch.inference_mode():
                self.last_stats = self.pipeline.run(requests, progress=progress)
            self._check_profile()
            return [self._result(r) for r in requests]

    def generate_iter(
        self, prompts: Iterable[Prompt], params: SamplingParams | Iterable[SamplingParams] | None = None,
        progress: bool = False, keys: Iterable[int | str] | None = None,
    ) -> Iterator[GenerationResult]:
        """Yield each prompt's result as its row finishes (finish order; `index` is the prompt's position). Prompts
        (and per-row params and keys, when given as iterables) are read lazily, as slots free up: an iterator of
        prompts streams through one pipeline that is never drained between them. A bad prompt raises PromptError
        when it is read. `last_stats` is set once the iterator is exhausted."""
        keys_it = iter(keys) if keys is not None else itertools.count()
        if params is None or isinstance(params, SamplingParams):
            params_it: Iterator[SamplingParams] = itertools.repeat(params or SamplingParams())
        else:
            params_it = iter(params)
        return self.stream(zip(prompts, params_it, keys_it), progress)

    def stream(self, rows: Iterable[tuple[Prompt, SamplingParams, int | str]] | Feed[tuple[Prompt, SamplingParams,
                                                                                             int | str]],
               progress: bool = False) -> Iterator[GenerationResult]:
        """`generate_iter` over (prompt, its params, its key) rows: the one pipeline a job streams through. rows may
        be a `Feed` that the caller fills while the stream runs (a replica's leased chunks): the stream then idles
        while it is open and empty and ends once it is closed and drained; a result's `index` is its row's position
        in the order the rows were put."""
        counter = itertools.count()
        prompt_tokens = 0  # of the rows read so far: the replanner prices the prefill share at their running mean

        def request(row: tuple[Prompt, SamplingParams, int | str]) -> Request:
            nonlocal prompt_tokens
            i = next(counter)
            prompt, p, key = row
            r = self._request(i, self.encode(prompt, i), p, key)
            prompt_tokens += len(r.prompt)
            self.replanner.prompt_len = prompt_tokens / (i + 1)
            return r

        with self._turn("stream"):  # held from the first result asked for until exhausted or closed
            if self._blind is not None and self.plan.max_seq_len < self._blind.max_seq_len:
                self._switch(self._blind)  # (a stream's rows may be as long as the engine allows)
                self._job = None
            requests = rows.map(request) if isinstance(rows, (Feed, MappedFeed)) else map(request, rows)
            finished = self.pipeline.stream(requests, progress=progress)
            while True:
                with torch.inference_mode():  # around the runner's work only, not the caller's between two results
                    r = next(finished, None)
                if r is None:
                    break
                yield self._result(r)
            self.last_stats = self.pipeline.last_stats
            self._check_profile()

    def _check_profile(self) -> None:
        """A profile this run's passes found off (offload/replan.py `check_profile`) is measured again before the
        next engine uses it (offload/profiler.py `mark_stale`). Exact mode's passes are slower than the profile's
        kernels by design (GEMMs in blocks of 32 rows, runtime/models/linear.py): slower passes then correct this
        run's compute costs (replan.py) but leave the profile as it is; so do passes slowed by other processes
        (replan.py `busy_cores`)."""
        off = self.replanner.profile_off
        if off is not None and self.config.exact and off > 1:
            return
        if self.replanner.busy_cores is not None:  # the machine is busy now: the profile measured quiet stands
            return
        if off is not None and not self._profile_marked:
            self._profile_marked = True
            mark_stale(self.config, f"a job's decode passes took {off:.2f}x the predicted time")

    def _request(self, index: int, ids: list[int], p: SamplingParams, key: int | str) -> Request:
        if not isinstance(p, SamplingParams):  # (a SamplingParams checked its ranges when it was made)
            raise PromptError(f"request {index}: params must be a SamplingParams, got {type(p).__name__}")
        if p.logprobs is not None and p.logprobs > self.config.max_logprobs:
            raise PromptError(f"request {index}: logprobs = {p.logprobs} is more than max_logprobs = "
                              f"{self.config.max_logprobs} (raise the engine's max_logprobs to allow it)")
        eos = frozenset(self.target.config.eos_token_ids)
        if p.stop and self.tokenizer is None:
            raise PromptError(f"prompt {index}: stop strings need the target's tokenizer ({self.config.target} has "
                              "none); use stop_token_ids")
        max_new = min(p.max_new_tokens, self.max_seq_len - len(ids))
        return Request(index, ids, max_new, frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else eos),
                       seed=None if p.greedy else row_seed(p.seed, key), warp=p.warp,
                       penalties=(p.presence_penalty, p.frequency_penalty, p.repetition_penalty),
                       min_tokens=min(p.min_tokens, max_new), logprobs=p.logprobs,
                       user_stop_ids=frozenset(p.stop_token_ids), stop_strings=p.stop,
                       include_stop_str=p.include_stop_str_in_output,
                       decode=self._decode if p.stop else None)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _encode(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise PromptError("prompts must be a list of strings or of token-id lists")
        if len(prompts) == 0:
            raise PromptError("the prompt list is empty: nothing to generate")
        return [self.encode(prompt, i) for i, prompt in enumerate(prompts)]

    def encode(self, prompt: Prompt, index: int = 0) -> list[int]:
        """A prompt's token ids (text tokenized, bounded), checked against the vocabulary, the context and the KV
        length per row; PromptError naming it as prompt `index` otherwise."""
        i = index
        vocab = self.target.config.vocab_size
        context = self.target.config.max_position_embeddings
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise PromptError(f"prompt {i} is text but {self.config.target} has no tokenizer; pass token ids")
            try:
                encoded = encode_bounded(self.tokenizer, prompt, min(context, self.max_seq_len))  # bounded prefix
            except ValueError as err:  # not Unicode text
                raise PromptError(f"prompt {i}: {err}") from None
            if isinstance(encoded, TooLong):
                raise PromptError(f"prompt {i} has at least {encoded.at_least} tokens (counted on a prefix); the "
                                  f"target's context is {context} tokens and the KV caches hold {self.max_seq_len} "
                                  "(max_seq_len)")
            ids = encoded
        elif isinstance(prompt, bytes) or not isinstance(prompt, Sequence):
            raise PromptError(f"prompt {i} must be a string or a list of token ids, got {type(prompt).__name__}")
        else:
            if len(prompt) >= min(context, self.max_seq_len):  # before copying it
                raise PromptError(f"prompt {i} has {len(prompt)} tokens; the target's context is {context} tokens "
                                  f"and this engine's KV caches hold {self.max_seq_len} tokens per row (max_seq_len)")
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
        if len(ids) >= self.max_seq_len:
            raise PromptError(
                f"prompt {i} has {len(ids)} tokens; this engine's KV caches hold {self.max_seq_len} tokens per "
                "row (max_seq_len): raise max_seq_len or shorten the prompt"
            )
        return ids

    def _result(self, r: Request) -> GenerationResult:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(r.output, skip_special_tokens=True)
            if isinstance(r.stop_reason, str) and not r.include_stop_str:  # cut before the first stop string
                text = text[: min(i for s in r.stop_strings if (i := text.find(s)) >= 0)]
        logprobs = r.token_logprobs if r.logprobs is not None else None
        return GenerationResult(
            index=r.index,
            prompt_token_ids=r.prompt,
            token_ids=r.output,
            text=text,
            finish_reason=r.finish_reason or "length",
            num_drafted=r.num_drafted,
            num_accepted=r.num_accepted,
            stop_reason=r.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=sum(t[0][1] for t in logprobs) if logprobs is not None else None,
            time_to_first_token_s=None if r.first_token_at is None else r.first_token_at - r.arrival,
            time_s=None if r.finished_at is None else r.finished_at - r.arrival,
        )

    def close(self) -> None:
        """Release the workers (reader threads, files, shared memory of a backend)."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None


def _per_row(params: SamplingParams | Sequence[SamplingParams] | None, rows: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * rows
    per_row = list(params)
    if len(per_row) != rows:
        raise ValueError(f"params: one SamplingParams, or a sequence of one per prompt ({rows}); got {len(per_row)}")
    bad = next((i for i, p in enumerate(per_row) if not isinstance(p, SamplingParams)), None)
    if bad is not None:
        raise PromptError(f"request {bad}: params must be a SamplingParams, got {type(per_row[bad]).__name__}")
    return per_row


__all__ = ["Engine", "GenerateStats", "OffloadStats", "PromptError", "Prompt", "VocabularyMismatchError"]
