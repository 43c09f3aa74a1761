"""Cost model of the offloaded pipeline: seconds per step and per workload from a profile, shapes and a placement.

Symbols (schedule.py's convention: step i, layer j, batch k). A *step* is one target pass over batch A, with
B = `batch` rows, each fed k + 1 tokens (its last committed token and k drafts), while the draft proposes k
tokens for the other batch. L layers; the head is pseudo-layer L. Per pass, with n = B * (k + 1) tokens fed:

    load_j  = streamed bytes of slot group j / stream_bytes_per_s           (0 when layer j is resident)
              (a compressed part: stored bytes / read_bytes_per_s + its compute-dtype bytes / decompress rate,
              read and decompression one after the other on the loader's thread: `stream_seconds`)
    attn_j  = attention_seconds(n, attended_len)                             [cpu]
    ffn_j   = F_dense_j * n / rate(n) + F_exp_j * n / rate(max(1, n * top_k / E))    [device]
              (rate: the resident, packed-layout GEMM rate when layer j is resident and the profile has one)
    head    = F_head * n / head_rate(n)                                      [device]
    draft   = k * draft_seconds(B)                                           [device]
    o       = pass_overhead_s + position_overhead_s * head rows   (embed, verify, bookkeeping; head rows = n in a
              decode pass, B in a prefill: both calibrated on measured passes, runtime/offload/calibrate.py)

F_dense_j: FLOPs per token of layer j's dense MLP and router (2 per parameter); F_exp_j: top_k experts of E per
token; each expert GEMM sees n * top_k / E rows on average, so at small n the experts cost their weight-read
time, as on the real device. The embedding costs nothing.

    T_chain   the steady-state period of the serial target pass (o, attn_0, ffn_0, ..., head) when a ring of
              num_buffers slots streams the loads in order: load m starts when the io is free and slot
              m % num_buffers is released by the ffn (or head) of load m - num_buffers, so loads run ahead into
              the next pass; ffn_j waits for load_j (attn_j too when layer j's attention streams). Simulated.
    T_io      = sum_j load_j
    shared compute (CPU-only: cpu and device are the same cores; the draft fills the chain's stalls):
        T_step = max(T_io, T_chain, sum_j (attn_j + ffn_j) + head + o + draft)
    separate compute (GPU: attention on the CPU, ffn / head / draft on the device):
        T_step = max(T_io, T_chain, sum_j attn_j + o, sum_j ffn_j + head + draft)

    tokens_per_step = B * E(k) with E the tokens per round of the acceptance (acceptance.py: Leviathan's eq. 1
                      for a scalar alpha, the per-position curve for an `AcceptanceCurve`; k = 0: B).

Refilled batches (the engine's continuous batching, runtime/offload/batches.py): a finished row's slot takes a
waiting prompt at once and the batch's next pass prefills it beside the other rows' decode tokens, so once every
slot is taken a batch runs passes that all look alike; `steady_pass` prices one of them (B rows, N = the mean new
tokens a row generates, P = the mean prompt length):

    R        = E[decode rounds of a row] for its N - 1 tokens after the prefill pass (acceptance.py `mean_rounds`;
               drafts are ragged, row r verifying min(k, remaining - 1): the rounds are those of untruncated ones)
    E_row    = N / (1 + R)        tokens a row commits per pass: E(k) per decode round, 1 at its first verify (its
                                  prefill pass carries no drafts); N / (1 + N - 1) = 1 at k = 0
    f        = B E_row / N = B / (1 + R)     rows finishing per pass, each replaced by a waiting prompt
    p        = f P                prompt tokens per pass (the prefill share)
    T_pass   = the mean of two kinds of pass, each max(io, compute) of its own (an average pass would hide a
               prompt's compute under the other passes' io): a decode pass, B (k + 1) tokens (an upper bound: a
               row in its prefill pass or its last, ragged, rounds feeds fewer), and, on the share min(1, f) of
               passes, one that also carries p / min(1, f) prompt tokens: they add to the FFN's tokens, bring their
               own attention (queries at the prompt's mean KV length P / 2; the runtime computes a ragged pass's
               valid tokens only, the decode rows' scores apart from the prompt's: runtime/models/layers.py
               `attention_forward`) beside the decode rows' at P + N / 2, and the draft prefills them too
               (draft_seconds(p / min(1, f))). The io is a decode pass's.
    tokens/s = B E_row / T_pass

and the per-pass prompt token budget (`Plan.prefill_chunk`) is what the compute headroom under the io holds
(`prefill_budget`). A job ends with a drain: once no prompt waits, a batch runs until its longest remaining row is
done while its other slots empty. The remaining work of its rows is taken as spread evenly over that drain, D passes
long with D the rounds of the slowest of B rows run to the token cap (`rounds_for_slowest`), so the drain leaves
half its slot-passes idle: D / 2 passes per batch on top of the steady ones (measured: 64 HumanEval prompts on 16
rows, 513 passes against 440 steady + 64 drain; 64 aclsum summaries, 379 against 326 + 64). Not modelled: the first
fill, a prompt cut into chunks holding its slot for more passes.

Model-free drafters (prompt lookup, suffix matching: `ModelCosts.draft_model_free`, an empty draft shape): the
draft costs no FLOPs, no weights and no KV, only each row's proposal at a round's start (draft = B x proposal_s, the
measured microseconds of `RaggedAcceptance`, 0 unmeasured; nothing in a prefill). Its drafts are ragged: a row
proposes only when it matches, so with a `RaggedAcceptance` a decode pass feeds the FFN n = B E[fed](k) =
B (1 + sum_{i<=k} P(L >= i)) valid tokens (1 + match rate x mean proposed length per row, not k + 1), attention and
head see every row padded to the expected longest feed, and tokens_per_step = B E[tokens](k) with
E[tokens](k) = 1 + sum_{i<=k} P(A >= i) from the replayed per-position acceptance (acceptance.py).

Selected-expert loading (planner/experts.py): when the engine loads only routed experts, a streamed MoE layer's
load_j counts its experts' bytes times E[distinct experts hit by n tokens] / num_experts (uniform routing: a
skewed router hits fewer, so this errs high).

Not modelled: io contending with compute for the cores, the draft's first token of a round feeding ~E tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from .acceptance import Acceptance, RaggedAcceptance, fed_per_round, mean_rounds, rounds_for_slowest, tokens_per_round
from .experts import expected_distinct_experts, selects_experts
from .placement import Placement, slot_unit
from .profile import HardwareProfile, ProfileError
from .shapes import ModelShape, PartKey


@dataclass(frozen=True)
class ModelCosts:
    """FLOPs and bytes per layer of the target and the draft, from shapes (no weights).

    A part of P = bytes / dtype_bytes parameters costs 2 * P FLOPs per token (norm vectors are counted as if they
    were weights: negligible); an MoE layer runs top_k of its num_experts experts per token; the embedding
    costs nothing. num_experts must match the expert parts of the shape (0 for a dense model).
    """

    target: ModelShape
    draft: ModelShape | None
    dtype_bytes: int = 2
    num_experts: int = 0
    top_k: int = 0
    draft_num_experts: int = 0
    draft_top_k: int = 0
    draft_dtype_bytes: int = 0  # the draft's compute dtype when it differs from the target's (0: the same)

    def __post_init__(self) -> None:
        if isinstance(self.dtype_bytes, bool) or not isinstance(self.dtype_bytes, int) or self.dtype_bytes < 1:
            raise ValueError(f"dtype_bytes must be an integer >= 1, got {self.dtype_bytes!r}")
        _check_experts(self.target, self.num_experts, self.top_k)
        if self.draft is not None:
            _check_experts(self.draft, self.draft_num_experts, self.draft_top_k)

    @classmethod
    def from_shapes(
        cls, target: ModelShape, draft: ModelShape | None, dtype_bytes: int = 2, top_k: int = 0, draft_top_k: int = 0,
        draft_dtype_bytes: int = 0,
    ) -> ModelCosts:
        """Costs with num_experts counted from the shapes' expert parts (top_k cannot be: it is config)."""
        draft_experts = _experts_per_layer(draft) if draft is not None else 0
        return cls(target, draft, dtype_bytes, _experts_per_layer(target), top_k, draft_experts, draft_top_k,
                   draft_dtype_bytes)

    @cached_property
    def _target_layers(self) -> tuple[tuple[float, float, float], ...]:
        """Per layer: FLOPs per token of (attention, dense mlp + router, top_k experts)."""
        attention = [0.0] * self.target.num_layers
        dense = [0.0] * self.target.num_layers
        experts = [0.0] * self.target.num_layers
        for key, nbytes in self.target.parts:
            flops = 2.0 * nbytes / self.dtype_bytes
            if key.kind == "attention":
                attention[key.layer] += flops
            elif key.kind in ("dense_mlp", "router"):
                dense[key.layer] += flops
            elif key.kind == "expert":
                experts[key.layer] += flops * self.top_k / self.num_experts
        return tuple(zip(attention, dense, experts))

    def attention_flops(self, layer: int) -> float:
        """FLOPs per token of layer `layer`'s attention projections (the attention fit covers them)."""
        return self._target_layers[layer][0]

    def dense_flops(self, layer: int) -> float:
        """FLOPs per token of layer `layer`'s dense MLP and router: the GEMMs that see every token."""
        return self._target_layers[layer][1]

    def expert_flops(self, layer: int) -> float:
        """FLOPs per token of layer `layer`'s routed experts: top_k of num_experts."""
        return self._target_layers[layer][2]

    @cached_property
    def head_flops(self) -> float:
        """FLOPs per token of the target's head (final norm + LM head)."""
        return sum(2.0 * n / self.dtype_bytes for key, n in self.target.parts if key.kind == "head")

    @cached_property
    def target_flops_per_token(self) -> float:
        return _flops_per_token(self.target, self.dtype_bytes, self.num_experts, self.top_k)

    @cached_property
    def draft_flops_per_token(self) -> float:
        if self.draft is None:
            return 0.0
        return _flops_per_token(self.draft, self.draft_dtype_bytes or self.dtype_bytes, self.draft_num_experts,
                                self.draft_top_k)

    @property
    def draft_model_free(self) -> bool:
        """The drafter holds no model (an empty shape: prompt lookup, suffix matching): its draft costs no FLOPs,
        only its proposals' microseconds (`RaggedAcceptance.proposal_s`)."""
        return self.draft is not None and not self.draft.parts

    @property
    def draft_shares_kv(self) -> bool:
        """The drafter drafts into the target's KV cache (a shape with parts and no KV of its own: the target drafting
        for itself in its process, runtime/offload/drafters/shared_kv.py): it never prefills a prompt, the target's
        pass has written the prompt's keys and values."""
        return self.draft is not None and bool(self.draft.parts) and self.draft.kv_bytes_per_token == 0

    @property
    def expert_fraction(self) -> float:
        """top_k / num_experts: the share of an MoE layer's tokens each expert sees (1 for a dense model)."""
        return self.top_k / self.num_experts if self.num_experts else 1.0


#: prompt lengths a Workload keeps (evenly spaced quantiles of the job's): enough for the padded prefill
PROMPT_LEN_SAMPLE = 1024


@dataclass(frozen=True)
class Workload:
    """What is generated: `num_prompts` prompts of mean `prompt_len` tokens, at most `new_tokens` tokens each.
    prompt_lens: the prompts' lengths (or a sample: `of_prompts` keeps evenly spaced quantiles), for the prefill's
    padding; empty: every prompt is taken to be prompt_len long.
    mean_new_tokens: the tokens a row actually generates on average (below new_tokens when rows stop at EOS; a
    warm-up measures it, runtime/warmup.py); 0 (the default) means new_tokens."""

    num_prompts: int
    prompt_len: float
    new_tokens: int
    prompt_lens: tuple[int, ...] = ()
    mean_new_tokens: float = 0.0

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.new_tokens < 1 or not self.prompt_len >= 1:
            raise ValueError(f"a workload needs num_prompts, prompt_len and new_tokens >= 1, got {self}")
        if any(n < 1 for n in self.prompt_lens):
            raise ValueError("prompt_lens must all be >= 1")
        if self.mean_new_tokens == 0:
            object.__setattr__(self, "mean_new_tokens", float(self.new_tokens))
        if not 1 <= self.mean_new_tokens <= self.new_tokens:
            raise ValueError(f"mean_new_tokens must lie in [1, new_tokens = {self.new_tokens}], "
                             f"got {self.mean_new_tokens}")
        object.__setattr__(self, "mean_new_tokens", float(self.mean_new_tokens))
        object.__setattr__(self, "prompt_lens", tuple(sorted(int(n) for n in self.prompt_lens)))

    @classmethod
    def of_prompts(cls, lengths: Sequence[int], new_tokens: int, mean_new_tokens: float = 0.0) -> Workload:
        """The workload of prompts of these lengths (at most PROMPT_LEN_SAMPLE of them kept, as quantiles)."""
        ordered = sorted(lengths)
        n = len(ordered)
        sample = ordered if n <= PROMPT_LEN_SAMPLE else [ordered[(i * (n - 1)) // (PROMPT_LEN_SAMPLE - 1)]
                                                         for i in range(PROMPT_LEN_SAMPLE)]
        return cls(num_prompts=n, prompt_len=sum(ordered) / n if n else 0, new_tokens=new_tokens,
                   prompt_lens=tuple(sample), mean_new_tokens=mean_new_tokens)

    def padded_len(self, rows: int) -> float:
        """Expected longest prompt of a batch of `rows` prompts (the length a prefill pads every row to):
        sum_i L_(i) ((i / n)^rows - ((i - 1) / n)^rows) over the sorted lengths (draws with replacement);
        prompt_len without lengths."""
        lens = self.prompt_lens
        if not lens:
            return float(self.prompt_len)
        n = len(lens)
        return sum(length * ((i / n) ** rows - ((i - 1) / n) ** rows) for i, length in enumerate(lens, start=1))


@dataclass(frozen=True)
class StepEstimate:
    """Predicted seconds of one step (module docstring):

        T_step = max(T_io, T_chain, compute)  with compute = attention + ffn + head + overhead + draft when
                 shared, else max(attention + overhead [cpu], ffn + head + draft [device]);
        (host attention beside a GPU: each layer's hidden-state copies to the host and back, `t_link`, lie on
        the chain only: the copy engine is neither the CPU nor the GPU's compute);
        tokens_per_s = tokens_per_step / T_step.

    Times are per step, summed over layers; `bound` names the term that sets T_step.
    """

    t_io: float
    t_attention: float
    t_ffn: float
    t_head: float
    t_overhead: float
    t_draft: float
    t_chain: float
    t_step: float
    tokens_per_step: float
    tokens_per_s: float
    bound: str  # "io" | "chain" | "compute" (shared) | "cpu" | "device"
    t_compute: float = 0.0  # the pass's seconds were the stream infinitely fast (the chain without load waits)
    t_link: float = 0.0  # hidden-state copies host <-> device of host attention (in the chain only)


@dataclass(frozen=True)
class SteadyPass:
    """One pass of a refilled batch in the steady state (`steady_pass`): `step` carries the pass's prefill share,
    `decode` is the same pass without it; the rest are the terms of the module docstring's steady-state section."""

    step: StepEstimate  # tokens_per_step = rows x tokens_per_row
    decode: StepEstimate
    rounds: float  # R: decode rounds per row
    tokens_per_row: float  # E_row = N / (1 + R): tokens a row commits per pass, its prefill pass included
    starts: float  # f = rows / (1 + R): rows finishing, and prompts starting, per pass
    prefill_tokens: float  # p = f x P: prompt tokens per pass
    prefill_chunk: int | None  # the per-pass prompt token budget (`prefill_budget`); None when nothing streams


@dataclass(frozen=True)
class WorkloadEstimate:
    """Predicted time of a whole workload (see `estimate_workload`)."""

    tokens_per_s: float  # generated tokens / total_s
    total_s: float
    prefill_s: float  # with refill: the passes' time beyond their decode-only time (the prefill share)
    decode_s: float
    waves: int  # with refill: times every slot is filled, ceil(num_prompts / (rows x num_batches))
    num_batches: int
    rows: int  # rows per batch actually used: min(batch, ceil(num_prompts / num_batches))
    decode_steps: int  # per wave; with refill: the passes of the whole run, round(num_prompts (1 + R) / rows)
    prefill: StepEstimate
    step: StepEstimate  # with refill: the steady pass, its prefill share included (`steady.step`)
    steady: SteadyPass | None = None  # priced in the steady state of refilled batches (None: in waves)


def stream_bytes(placement: Placement, target: ModelShape, expert_share: float = 1.0,
                 units: bool = False) -> dict:
    """Slot group -> bytes streamed per pass (layer j, or num_layers for the head); resident groups absent.
    expert_share: the fraction of a streamed layer's experts a pass reads (selected loading; planner/experts.py).
    units: key by load unit (layer, expert group) instead (placement.py `slot_unit`)."""
    groups: dict = {}
    for key, nbytes in target.parts:
        if placement.is_streamed(key):
            unit = slot_unit(key, target.num_layers, placement.policy.expert_group)
            group = unit if units else unit[0]
            groups[group] = groups.get(group, 0) + nbytes * (expert_share if key.kind == "expert" else 1.0)
    return groups


def stream_seconds(profile: HardwareProfile, placement: Placement, target: ModelShape,
                   expert_share: float = 1.0) -> dict:
    """Load unit -> the loader's seconds per pass (`HardwareProfile.load_seconds` of each streamed part: compressed
    parts at the read + decompression rates, others at the stream rate); resident units absent."""
    stored = target.stored_bytes()
    loads: dict = {}
    for key, nbytes in target.parts:
        if placement.is_streamed(key):
            unit = slot_unit(key, target.num_layers, placement.policy.expert_group)
            share = expert_share if key.kind == "expert" else 1.0
            loads[unit] = loads.get(unit, 0.0) + share * profile.load_seconds(nbytes, stored.get(key))
    return loads


def _expert_share(costs: ModelCosts, placement: Placement, expert_loading: str, plan_tokens: int, fed: int) -> float:
    """The share of a streamed MoE layer's experts one pass of `fed` tokens reads: all of them, unless the engine
    loads only routed experts (decided once for its plan's batch x (k + 1) tokens, as runtime/engine.py does),
    then the expected distinct share for `fed` tokens under uniform routing."""
    e, top_k = costs.num_experts, costs.top_k
    if not selects_experts(placement, expert_loading, e, top_k, plan_tokens):
        return 1.0
    return expected_distinct_experts(e, top_k, fed) / e


def estimate_step(
    profile: HardwareProfile, costs: ModelCosts, placement: Placement, batch: int, k: int, alpha: Acceptance,
    attended_len: int, expert_loading: str = "auto", interleave: bool = True,
) -> StepEstimate:
    """One decode step: a target pass over `batch` rows of k + 1 tokens each, each token attending to
    `attended_len` keys (the mean KV length over the run, not the KV capacity) (module docstring).
    expert_loading: the engine's mode for streamed MoE layers ("auto", "selected", "all"; planner/experts.py).
    interleave False: one batch drafts for itself between its passes, so its k draft steps add to the serial
    chain (the loader streams on meanwhile: io is not delayed)."""
    _check_plan(profile, costs, placement, batch, k)
    fed, padded = _decode_feed(alpha, batch, k)
    share = _expert_share(costs, placement, expert_loading, batch * (k + 1), round(fed))
    return _pass(profile, costs, placement, fed, padded, attended_len, _decode_draft_s(profile, costs, alpha, batch, k),
                 batch * tokens_per_round(alpha, k), share, serial_draft=not interleave, attention_tokens=padded)


def estimate_prefill(
    profile: HardwareProfile, costs: ModelCosts, placement: Placement, batch: int, k: int, prompt_len: float,
    expert_loading: str = "auto", interleave: bool = True, padded_len: float | None = None,
) -> StepEstimate:
    """A batch's first pass (prefill merged into it): `batch` rows of prompt_len tokens, one token out per row.

    Every row is padded to the batch's longest prompt, `padded_len` (default prompt_len): the attention computes
    batch * padded_len queries, each against the keys before it, attended_len = ceil((padded_len + 1) / 2) on average
    (measured, 16 prose prompts of mean 122 and longest 329 tokens: 13.1 s of attention against 15.5 modelled,
    21.9 with the full score matrix, 5.3 at the mean length), while the FFN runs on the fed =
    round(batch * prompt_len) valid tokens only (34 s against 38 modelled); the head sees one position per row.
    Meanwhile the draft prefills the other batch and proposes its first k tokens:
    draft_seconds(fed) + (k - 1) * draft_seconds(batch); a draft that shares the target's KV cache prefills nothing:
    k * draft_seconds(batch).
    """
    _check_plan(profile, costs, placement, batch, k)
    fed = max(batch, round(batch * prompt_len))
    padded = max(prompt_len, padded_len or prompt_len)
    t_draft = profile.draft_seconds(fed) + (k - 1) * profile.draft_seconds(batch) if k else 0.0
    if k and costs.draft_shares_kv:  # the target's pass wrote the prompt's keys and values: nothing to prefill
        t_draft = k * profile.draft_seconds(batch)
    if costs.draft_model_free:  # a matching drafter prefills nothing; its first proposal is a decode round's
        t_draft = 0.0
    share = _expert_share(costs, placement, expert_loading, batch * (k + 1), fed)
    return _pass(profile, costs, placement, fed, batch, math.ceil((padded + 1) / 2), t_draft, float(batch), share,
                 serial_draft=not interleave, attention_tokens=max(fed, round(batch * padded)))


def estimate_workload(
    profile: HardwareProfile,
    costs: ModelCosts,
    placement: Placement,
    batch: int,
    k: int,
    alpha: Acceptance,
    workload: Workload,
    expert_loading: str = "auto",
    interleave: bool = True,
    refill: bool = False,
) -> WorkloadEstimate:
    """Whole-workload time. num_batches = 2 with a draft interleaving (k >= 1), else 1;
    rows = min(batch, ceil(num_prompts / num_batches)) (a batch never holds more rows than prompts).

    refill (the engine's continuous batching) with prompts left waiting once every slot is taken
    (num_prompts > rows x num_batches): the steady state (`steady_pass`, module docstring),

        passes = num_prompts (1 + R) / rows + num_batches R_slowest(new_tokens - 1) / 2   (the drain),
        total = passes x T_pass,   tokens/s = num_prompts x mean_new_tokens / total.

    Otherwise (refill False, or every prompt fits in the first fill: nothing to refill with) in waves of
    num_batches batches:

        waves = ceil(num_prompts / (rows * num_batches))
        decode_steps per wave = num_batches * round(R_slowest(new_tokens - 1))     (the prefill pass emits one)
        total = waves * (num_batches * T_prefill + decode_steps * T_step)
    with T_step at the mean KV length prompt_len + new_tokens / 2, the prefill padded to the expected longest prompt
    of a batch (`Workload.padded_len`); R_slowest the rounds the slowest of the batch's rows needs (a batch is
    refilled only when all its rows are done; acceptance.py `rounds_for_slowest`: the expected rounds of one row
    for a batch of one, new_tokens - 1 at k = 0). Every wave is costed as full; the slowest row is taken to run to
    new_tokens. Either way tokens/s counts num_prompts x mean_new_tokens generated tokens.
    """
    num_batches = 2 if k >= 1 and interleave else 1
    rows = min(batch, math.ceil(workload.num_prompts / num_batches))
    waves = math.ceil(workload.num_prompts / (rows * num_batches))
    prefill = estimate_prefill(profile, costs, placement, rows, k, workload.prompt_len, expert_loading, interleave,
                               padded_len=workload.padded_len(rows))
    generated = workload.num_prompts * workload.mean_new_tokens
    if refill and workload.num_prompts > rows * num_batches:
        steady = steady_pass(profile, costs, placement, rows, k, alpha, workload, expert_loading, interleave)
        drain = num_batches * rounds_for_slowest(alpha, k, workload.new_tokens - 1, rows) / 2  # (docstring)
        passes = workload.num_prompts * (1 + steady.rounds) / rows + drain
        total = passes * steady.step.t_step
        decode_s = passes * steady.decode.t_step
        return WorkloadEstimate(tokens_per_s=generated / total, total_s=total, prefill_s=total - decode_s,
                                decode_s=decode_s, waves=waves, num_batches=num_batches, rows=rows,
                                decode_steps=round(passes), prefill=prefill, step=steady.step, steady=steady)
    attended_len = round(workload.prompt_len + workload.new_tokens / 2)
    step = estimate_step(profile, costs, placement, rows, k, alpha, attended_len, expert_loading, interleave)
    decode_steps = num_batches * round(rounds_for_slowest(alpha, k, workload.new_tokens - 1, rows))
    prefill_s = waves * num_batches * prefill.t_step
    decode_s = waves * decode_steps * step.t_step
    total = prefill_s + decode_s
    return WorkloadEstimate(
        tokens_per_s=generated / total,
        total_s=total,
        prefill_s=prefill_s,
        decode_s=decode_s,
        waves=waves,
        num_batches=num_batches,
        rows=rows,
        decode_steps=decode_steps,
        prefill=prefill,
        step=step,
    )


def steady_pass(
    profile: HardwareProfile, costs: ModelCosts, placement: Placement, rows: int, k: int, alpha: Acceptance,
    workload: Workload, expert_loading: str = "auto", interleave: bool = True, attended_len: int | None = None,
) -> SteadyPass:
    """A pass of a batch of `rows` refilled rows in the steady state (module docstring, "Refilled batches"):
    N = workload.mean_new_tokens, P = workload.prompt_len; attended_len (keys per decode token) defaults to the
    mean KV length round(P + N / 2)."""
    _check_plan(profile, costs, placement, rows, k)
    n_out, prompt = workload.mean_new_tokens, workload.prompt_len
    attended = attended_len if attended_len is not None else round(prompt + n_out / 2)
    rounds = mean_rounds(alpha, k, max(0, round(n_out - 1)))
    per_row = n_out / (1 + rounds)
    starts = rows / (1 + rounds)
    prefill_tokens = starts * prompt
    burst = min(1.0, starts)  # the share of passes that carry a prompt
    decode_fed, decode_padded = _decode_feed(alpha, rows, k)
    share = _expert_share(costs, placement, expert_loading, rows * (k + 1), round(decode_fed))  # a decode pass's io
    t_draft = _decode_draft_s(profile, costs, alpha, rows, k)
    attn = profile.attention_seconds(decode_padded, attended)
    decode = _pass(profile, costs, placement, decode_fed, decode_padded, attended, t_draft, rows * per_row, share,
                   serial_draft=not interleave, attention_s=attn)
    # a pass that carries a prompt (the share `burst` of passes): the decode rows' attention and the prompt's own
    # (its tokens at P / 2 keys); priced as a pass of its own, since max(io, compute) of the average pass would
    # hide a prompt's compute under the other passes' io
    carried = prefill_tokens / burst  # [prompt tokens per carrying pass]
    burst_attn = (attn + profile.attention_seconds(round(carried), round(prompt / 2))
                  - profile.attention_fit[0])  # (one op: its fixed cost once)
    # a draft model prefills the prompt too; matching does not, nor does a draft sharing the target's KV cache
    prefills_draft = k and not costs.draft_model_free and not costs.draft_shares_kv
    t_draft_prefill = t_draft + (profile.draft_seconds(carried) if prefills_draft else 0.0)
    carrying = _pass(profile, costs, placement, decode_fed + carried, decode_padded, attended, t_draft_prefill,
                     rows * per_row, share, serial_draft=not interleave, attention_s=burst_attn)
    step = _blend(decode, carrying, burst)
    return SteadyPass(step=step, decode=decode, rounds=rounds, tokens_per_row=per_row, starts=starts,
                      prefill_tokens=prefill_tokens, prefill_chunk=prefill_budget(step, decode, prefill_tokens))


def _blend(plain: StepEstimate, carrying: StepEstimate, share: float) -> StepEstimate:
    """The mean pass of a refilled batch: `share` of its passes carry a prompt (`carrying`), the rest only decode
    (`plain`); every time term is the share-weighted mean, tokens_per_s the tokens per pass over that mean."""
    if share >= 1.0:
        return carrying
    mix = {f: (1 - share) * getattr(plain, f) + share * getattr(carrying, f)
           for f in ("t_io", "t_attention", "t_ffn", "t_head", "t_overhead", "t_draft", "t_chain", "t_step",
                     "tokens_per_step", "t_compute", "t_link")}
    bound = carrying.bound if share * carrying.t_step >= (1 - share) * plain.t_step else plain.bound
    return StepEstimate(**mix, tokens_per_s=mix["tokens_per_step"] / mix["t_step"], bound=bound)


def prefill_budget(step: StepEstimate, decode: StepEstimate, prefill_tokens: float) -> int | None:
    """Prompt tokens one pass may feed (`Plan.prefill_chunk`): as many as the compute headroom under the io holds,

        chunk = max(floor((T_io - C_decode) / s),  ceil(p),  1),   s = (C_pass - C_decode) / p

    with C the pass's compute (`StepEstimate.t_compute`: every term but the io) with (C_pass) and without (C_decode)
    its prefill share of p prompt tokens, so s is the seconds of compute one prompt token adds; never below p, or
    the prompts would fall behind the rows that finish. None when nothing streams (no io to hide prefill under) or
    a prompt token costs nothing."""
    if decode.t_io <= 0 or prefill_tokens <= 0:
        return None
    per_token = (step.t_compute - decode.t_compute) / prefill_tokens
    if per_token <= 0:
        return None
    headroom = math.floor(max(0.0, decode.t_io - decode.t_compute) / per_token)
    return max(headroom, math.ceil(prefill_tokens - 1e-9), 1)


# --- internals -----------------------------------------------------------------------------------------------


def _decode_feed(alpha: Acceptance, rows: int, k: int) -> tuple[float, int]:
    """(row-tokens the FFN sees, queries the attention and head see) of a decode pass of `rows` rows at k:
    rows (k + 1) both for a draft model's fixed drafts; for ragged drafts (`RaggedAcceptance`) rows E[fed](k) valid
    tokens, every row padded to the expected longest feed for attention (acceptance.py)."""
    if isinstance(alpha, RaggedAcceptance) and k:
        return rows * fed_per_round(alpha, k), max(rows, round(rows * alpha.padded(k, rows)))
    return float(rows * (k + 1)), rows * (k + 1)


def _decode_draft_s(profile: HardwareProfile, costs: ModelCosts, alpha: Acceptance, rows: int, k: int) -> float:
    """The draft's seconds per decode round: k draft model steps over `rows` rows; a model-free drafter's rows
    proposals (`RaggedAcceptance.proposal_s` each, 0 unmeasured)."""
    if not k:
        return 0.0
    if costs.draft_model_free:
        return rows * alpha.proposal_s if isinstance(alpha, RaggedAcceptance) else 0.0
    return k * profile.draft_seconds(rows)


@dataclass(frozen=True)
class ChainLink:
    """One link of the serial target chain: `pre` (attention), then `post` (ffn or head) after its load."""

    pre: float
    post: float
    load: float | None  # seconds of this slot group's load; None when resident
    pre_waits: bool = False  # the attention weights stream with the layer: attention waits for the load too


def chain_period(layers: Sequence[ChainLink], overhead: float, num_buffers: int, passes: int | None = None) -> float:
    """Steady-state seconds per pass of the serial chain overhead, layers[0], ..., layers[-1] (module docstring).

    Simulates `passes` consecutive passes (default 4 * num_buffers + 8) and averages the second half, which
    also covers a chain that settles into a cycle of several passes.
    """
    passes = passes if passes is not None else 4 * num_buffers + 8
    release: list[float] = []  # load index -> when its slot's last user finished
    io_free = t = 0.0
    ends: list[float] = []
    for _ in range(passes):
        t += overhead
        for layer in layers:
            ready = t
            if layer.load is not None:
                m = len(release)
                start = max(io_free, release[m - num_buffers] if m >= num_buffers else 0.0)
                io_free = ready = start + layer.load
            pre_end = (max(t, ready) if layer.pre_waits else t) + layer.pre
            t = max(pre_end, ready) + layer.post
            if layer.load is not None:
                release.append(t)
        ends.append(t)
    half = passes // 2
    return (ends[-1] - ends[half - 1]) / (passes - half)


def _pass(
    profile: HardwareProfile,
    costs: ModelCosts,
    placement: Placement,
    fed: float,
    head_rows: int,
    attended_len: int,
    t_draft: float,
    tokens: float,
    expert_share: float = 1.0,
    serial_draft: bool = False,
    attention_tokens: int | None = None,
    attention_s: float | None = None,
) -> StepEstimate:
    """attention_s: one layer's attention seconds, when the caller prices it (a steady pass: `steady_pass`)."""
    target = costs.target
    loads = stream_seconds(profile, placement, target, expert_share)
    expert_rows = max(1.0, fed * costs.expert_fraction)
    attn = (attention_s if attention_s is not None
            else profile.attention_seconds(attention_tokens or fed, attended_len))  # padded queries (prefill)
    # attention on the host beside a GPU: the layer's hidden states [rows, T, H] go to the host and back, in the
    # chain between the layer's ffn and the next layer's (one copy each way)
    hidden_bytes = (attention_tokens or fed) * target.hidden_bytes_per_token
    link = 2 * profile.hidden_link_seconds(hidden_bytes) if placement.policy.host_attention else 0.0
    attn_link = attn + link
    layers = []
    for j in range(target.num_layers):
        units = sorted(g for layer, g in loads if layer == j)
        resident = not units  # resident weights use the packed-layout GEMM rate where one was measured
        ffn = profile.ffn_seconds(costs.dense_flops(j) * fed, fed, resident)
        ffn += profile.ffn_seconds(costs.expert_flops(j) * fed, expert_rows, resident)
        attention = PartKey("attention", j)
        streams_attention = attention in placement.tiers and placement.is_streamed(attention)
        # one link per load unit: the layer's ffn runs one expert group after another (an even share each)
        for n, g in enumerate(units or [0]):
            layers.append(ChainLink(attn_link if n == 0 else 0.0, ffn / max(len(units), 1), loads.get((j, g)),
                                    pre_waits=streams_attention and n == 0))
    head = profile.head_seconds(costs.head_flops * head_rows, head_rows)
    layers.append(ChainLink(0.0, head, loads.get((target.num_layers, 0))))
    overhead = profile.overhead_seconds(head_rows)
    t_io = sum(loads.values())
    t_attention = attn * target.num_layers
    t_ffn = sum(layer.post for layer in layers[:-1])
    t_chain = chain_period(layers, overhead, placement.num_buffers)
    terms = {"io": t_io, "chain": t_chain + (t_draft if serial_draft else 0.0)}
    free_chain = overhead + sum(link.pre + link.post for link in layers) + (t_draft if serial_draft else 0.0)
    if profile.shared_compute:
        terms["compute"] = t_attention + t_ffn + head + overhead + t_draft
    else:
        terms["cpu"] = t_attention + overhead
        terms["device"] = t_ffn + head + t_draft
    t_step = max(terms.values())
    bound = next(name for name, t in terms.items() if t >= t_step * (1 - 1e-9))  # ties: io, chain, then compute
    return StepEstimate(
        t_io=t_io,
        t_attention=t_attention,
        t_ffn=t_ffn,
        t_head=head,
        t_overhead=overhead,
        t_draft=t_draft,
        t_chain=t_chain,
        t_step=t_step,
        tokens_per_step=tokens,
        t_link=link * target.num_layers,
        tokens_per_s=tokens / t_step if t_step > 0 else math.inf,
        bound=bound,
        t_compute=max(free_chain, *(t for name, t in terms.items() if name not in ("io", "chain"))),
    )


def _check_plan(profile: HardwareProfile, costs: ModelCosts, placement: Placement, batch: int, k: int) -> None:
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an integer >= 0, got {k!r}")
    if k >= 1 and costs.draft is None:
        raise ValueError(f"k = {k} draft tokens need a draft model; costs.draft is None")
    if set(placement.tiers) != {key for key, _ in costs.target.parts}:
        raise ValueError("the placement was not made for this target shape (its parts differ)")
    if placement.policy.weights_tier != profile.weights_tier:
        raise ProfileError(
            f"the profile measured streaming from {profile.weights_tier!r} but the placement streams from "
            f"{placement.policy.weights_tier!r}: measure a profile for that tier or change weights_tier"
        )


def _flops_per_token(shape: ModelShape, dtype_bytes: int, num_experts: int, top_k: int) -> float:
    total = 0.0
    for key, nbytes in shape.parts:
        if key.kind == "embedding":
            continue
        share = top_k / num_experts if key.kind == "expert" else 1.0
        total += 2.0 * nbytes / dtype_bytes * share
    return total


def _experts_per_layer(shape: ModelShape) -> int:
    """The largest number of expert parts in one layer (0 for a dense model)."""
    counts: dict[int, int] = {}
    for key, _ in shape.parts:
        if key.kind == "expert":
            counts[key.layer] = counts.get(key.layer, 0) + 1
    return max(counts.values(), default=0)


def _check_experts(shape: ModelShape, num_experts: int, top_k: int) -> None:
    per_layer: dict[int, int] = {}
    for key, _ in shape.parts:
        if key.kind == "expert":
            per_layer[key.layer] = per_layer.get(key.layer, 0) + 1
    if not per_layer:
        if num_experts or top_k:
            raise ValueError(f"{shape.name}: num_experts/top_k given but the shape has no expert parts")
        return
    if set(per_layer.values()) != {num_experts}:
        counts = sorted(set(per_layer.values()))
        raise ValueError(f"{shape.name}: num_experts={num_experts} but its MoE layers hold {counts} experts")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{shape.name}: top_k must be in 1..{num_experts}, got {top_k}")
