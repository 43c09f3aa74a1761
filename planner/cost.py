"""Cost model of the offloaded pipeline: seconds per step and per workload from a profile, shapes and a placement.

Symbols (schedule.py's convention: step i, layer j, batch k). A *step* is one target pass over batch A, with
B = `batch` rows, each fed k + 1 tokens (its last committed token and k drafts), while the draft proposes k
tokens for the other batch. L layers; the head is pseudo-layer L. Per pass, with n = B * (k + 1) tokens fed:

    load_j  = streamed bytes of slot group j / stream_bytes_per_s           (0 when layer j is resident)
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

from .acceptance import Acceptance, rounds_for_slowest, tokens_per_round
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
    def expert_fraction(self) -> float:
        """top_k / num_experts: the share of an MoE layer's tokens each expert sees (1 for a dense model)."""
        return self.top_k / self.num_experts if self.num_experts else 1.0


#: prompt lengths a Workload keeps (evenly spaced quantiles of the job's): enough for the padded prefill
PROMPT_LEN_SAMPLE = 1024


@dataclass(frozen=True)
class Workload:
    """What is generated: `num_prompts` prompts of mean `prompt_len` tokens, `new_tokens` tokens each.
    prompt_lens: the prompts' lengths (or a sample: `of_prompts` keeps evenly spaced quantiles), for the prefill's
    padding; empty: every prompt is taken to be prompt_len long."""

    num_prompts: int
    prompt_len: float
    new_tokens: int
    prompt_lens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.new_tokens < 1 or not self.prompt_len >= 1:
            raise ValueError(f"a workload needs num_prompts, prompt_len and new_tokens >= 1, got {self}")
        if any(n < 1 for n in self.prompt_lens):
            raise ValueError("prompt_lens must all be >= 1")
        object.__setattr__(self, "prompt_lens", tuple(sorted(int(n) for n in self.prompt_lens)))

    @classmethod
    def of_prompts(cls, lengths: Sequence[int], new_tokens: int) -> Workload:
        """The workload of prompts of these lengths (at most PROMPT_LEN_SAMPLE of them kept, as quantiles)."""
        ordered = sorted(lengths)
        n = len(ordered)
        sample = ordered if n <= PROMPT_LEN_SAMPLE else [ordered[(i * (n - 1)) // (PROMPT_LEN_SAMPLE - 1)]
                                                         for i in range(PROMPT_LEN_SAMPLE)]
        return cls(num_prompts=n, prompt_len=sum(ordered) / n if n else 0, new_tokens=new_tokens,
                   prompt_lens=tuple(sample))

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


@dataclass(frozen=True)
class WorkloadEstimate:
    """Predicted time of a whole workload (see `estimate_workload`)."""

    tokens_per_s: float  # generated tokens / total_s
    total_s: float
    prefill_s: float
    decode_s: float
    waves: int
    num_batches: int
    rows: int  # rows per batch actually used: min(batch, ceil(num_prompts / num_batches))
    decode_steps: int  # per wave
    prefill: StepEstimate
    step: StepEstimate


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
    fed = batch * (k + 1)
    t_draft = k * profile.draft_seconds(batch) if k else 0.0
    share = _expert_share(costs, placement, expert_loading, fed, fed)
    return _pass(profile, costs, placement, fed, fed, attended_len, t_draft, batch * tokens_per_round(alpha, k), share,
                 serial_draft=not interleave)


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
    draft_seconds(fed) + (k - 1) * draft_seconds(batch).
    """
    _check_plan(profile, costs, placement, batch, k)
    fed = max(batch, round(batch * prompt_len))
    padded = max(prompt_len, padded_len or prompt_len)
    t_draft = profile.draft_seconds(fed) + (k - 1) * profile.draft_seconds(batch) if k else 0.0
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
) -> WorkloadEstimate:
    """Whole-workload time, in waves of num_batches batches (2 with a draft interleaving, k >= 1; else 1):

        rows  = min(batch, ceil(num_prompts / num_batches))          (a batch never holds more rows than prompts)
        waves = ceil(num_prompts / (rows * num_batches))
        decode_steps per wave = num_batches * round(R_slowest(new_tokens - 1))     (the prefill pass emits one)
        total = waves * (num_batches * T_prefill + decode_steps * T_step)
    with T_step at the mean KV length prompt_len + new_tokens / 2, the prefill padded to the expected longest prompt
    of a batch (`Workload.padded_len`); R_slowest the rounds the slowest of the batch's rows needs (a batch is
    refilled only when all its rows are done; acceptance.py `rounds_for_slowest`: the expected rounds of one row
    for a batch of one, new_tokens - 1 at k = 0). Every wave is costed as full.
    """
    num_batches = 2 if k >= 1 and interleave else 1
    rows = min(batch, math.ceil(workload.num_prompts / num_batches))
    waves = math.ceil(workload.num_prompts / (rows * num_batches))
    attended_len = round(workload.prompt_len + workload.new_tokens / 2)
    step = estimate_step(profile, costs, placement, rows, k, alpha, attended_len, expert_loading, interleave)
    prefill = estimate_prefill(profile, costs, placement, rows, k, workload.prompt_len, expert_loading, interleave,
                               padded_len=workload.padded_len(rows))
    decode_steps = num_batches * round(rounds_for_slowest(alpha, k, workload.new_tokens - 1, rows))
    prefill_s = waves * num_batches * prefill.t_step
    decode_s = waves * decode_steps * step.t_step
    total = prefill_s + decode_s
    return WorkloadEstimate(
        tokens_per_s=workload.num_prompts * workload.new_tokens / total,
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


# --- internals -----------------------------------------------------------------------------------------------


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
    fed: int,
    head_rows: int,
    attended_len: int,
    t_draft: float,
    tokens: float,
    expert_share: float = 1.0,
    serial_draft: bool = False,
    attention_tokens: int | None = None,
) -> StepEstimate:
    target = costs.target
    streamed = stream_bytes(placement, target, expert_share, units=True)
    loads = {unit: nbytes / profile.stream_bytes_per_s for unit, nbytes in streamed.items()}
    expert_rows = max(1.0, fed * costs.expert_fraction)
    attn = profile.attention_seconds(attention_tokens or fed, attended_len)  # padded queries (prefill)
    layers = []
    for j in range(target.num_layers):
        units = sorted(g for layer, g in loads if layer == j)
        resident = not units  # resident weights use the packed-layout GEMM rate where one was measured
        ffn = profile.ffn_seconds(costs.dense_flops(j) * fed, fed, resident)
        ffn += profile.ffn_seconds(costs.expert_flops(j) * fed, expert_rows, resident)
        streams_attention = placement.tiers.get(PartKey("attention", j), "device") != "device"
        # one link per load unit: the layer's ffn runs one expert group after another (an even share each)
        for n, g in enumerate(units or [0]):
            layers.append(ChainLink(attn if n == 0 else 0.0, ffn / max(len(units), 1), loads.get((j, g)),
                                    pre_waits=streams_attention and n == 0))
    head = profile.head_seconds(costs.head_flops * head_rows, head_rows)
    layers.append(ChainLink(0.0, head, loads.get((target.num_layers, 0))))
    overhead = profile.overhead_seconds(head_rows)
    t_io = sum(loads.values())
    t_attention = attn * target.num_layers
    t_ffn = sum(layer.post for layer in layers[:-1])
    t_chain = chain_period(layers, overhead, placement.num_buffers)
    terms = {"io": t_io, "chain": t_chain + (t_draft if serial_draft else 0.0)}
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
        tokens_per_s=tokens / t_step if t_step > 0 else math.inf,
        bound=bound,
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
