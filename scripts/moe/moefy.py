"""MoEfication (Zhang et al. 2022, "MoEfication: Transformer Feed-forward Layers are Mixtures of Experts"),
in its shared-plus-routed form (as in DeepSeekMoE's shared experts): each dense FFN's neurons are split, not
copied, into one shared expert and E equal routed experts, and a router is fitted from calibration statistics.
No training. With all neurons kept, a token that selected every expert would get the dense FFN back.

Per layer, on calibration tokens t with FFN input x_t (notation: a_tn = act(gate_n . x_t) * (up_n . x_t) is
neuron n's activation, d_n its column of the down projection, so FFN(x_t) = sum_n a_tn d_n):

1. Contribution c_tn = |a_tn| * ||d_n||. Neuron n is *active* on token t if it is among the token's top
   `active_fraction` of neurons by contribution; f_n = share of tokens it is active on.
2. Shared expert: the `shared` neurons of highest f_n (active on nearly every token).
3. Routed experts: the other neurons, clustered by co-activation (balanced spherical k-means of their binary
   activity patterns over tokens, so neurons that fire together land together), E clusters of equal size.
4. Router: the importance of expert e for token t is y_te = sum_{n in e} c_tn; the router is the ridge
   regression of y (centred per token, since only the ranking across experts matters) on x, computed on
   per-dimension standardised inputs and mapped back (a diagonal rescale the linear router absorbs).

Weights. An FFN split calls for the plain sum of the selected experts, but Qwen2-MoE multiplies each by its
renormalised softmax weight. So the router's temperature is set low (the median per-token spread of logits
across experts is `logit_std`, default 0.02) which makes the top-k weights 1/k to within about a percent, and
each routed expert's down projection is multiplied by k. The shared expert's sigmoid gate has zero weights,
so it is sigmoid(0) = 0.5 exactly, and its down projection is doubled (exact in floating point).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specoffload.runtime.models.checkpoint import Checkpoint
from specoffload.runtime.models.model import Transformer

from .build import check_disk, open_dense, staging, write_checkpoint
from .calibration import Calibration, FFNInput, ffn_inputs
from .errors import MoEBuildError
from .formats import MoEFormat, check_dense, moe_config
from .kmeans import balanced_kmeans
from .shards import HASHES, source_record, write_provenance
from .stats import hot_share

Tensor = torch.Tensor


@dataclass(frozen=True)
class MoefyParams:
    """Sizes and knobs. The default sizes were chosen on HumanEval 0-31 (teacher-forced top-1 agreement with the
    dense Qwen2.5-Coder-1.5B, 4.7k positions; share of FFN neurons active per token in brackets):
    16 experts top-4 shared 1792 (40%) 0.60, 8 top-2 (40%) 0.60, 32 top-8 (40%) 0.63, 16 top-8 (60%) 0.74,
    16 top-4 shared 4480 (62.5%) 0.77, 16 top-6 shared 4480 (69%) 0.79, **16 top-8 shared 3584 (70%) 0.80**,
    16 top-12 shared 1792 (80%) 0.84. Agreement grows with the active share; the default keeps it near 0.8 while
    a token still skips half the routed experts. The report in the built model's directory is measured on
    other prompts (HumanEval 100-131).
    """

    experts: int = 16  # routed experts per layer
    top_k: int = 8
    shared: int = 3584  # neurons of the shared expert; the rest are split evenly among the routed experts
    active_fraction: float = 0.25
    logit_std: float = 0.02
    ridge: float = 1e-3  # ridge strength relative to the mean diagonal of the (standardised) Gram matrix
    kmeans_iters: int = 15
    seed: int = 0

    def expert_width(self, intermediate: int) -> int:
        """Neurons per routed expert; an error if the sizes do not split `intermediate` exactly."""
        routed = intermediate - self.shared
        if self.experts < 2:
            raise MoEBuildError(f"--experts must be at least 2, got {self.experts}")
        if not 1 <= self.top_k <= self.experts:
            raise MoEBuildError(f"--top-k must be in 1..{self.experts} (--experts), got {self.top_k}")
        if not 0 <= self.shared < intermediate or routed % self.experts:
            raise MoEBuildError(
                f"--shared {self.shared} + --experts {self.experts} equal experts must split the "
                f"{intermediate} FFN neurons exactly ({routed} left for the routed experts)"
            )
        if not 0 < self.active_fraction <= 1:
            raise MoEBuildError(f"--active-fraction must be in (0, 1], got {self.active_fraction}")
        return routed // self.experts


@dataclass(frozen=True)
class LayerPlan:
    """One layer's split and router."""

    shared: Tensor  # [shared] neuron ids
    experts: Tensor  # [E, width] neuron ids
    gate: Tensor  # [E, hidden] float32 router
    stats: dict[str, float]


def plan_layer(item: FFNInput, params: MoefyParams) -> LayerPlan:
    """One dense layer's FFN inputs and weights (float32) -> the layer's split and router."""
    contribution = item.activations.abs() * item.mlp.down.norm(dim=0)  # [N, I]
    shared, experts, stats = split_neurons(activity(contribution, params.active_fraction), params)
    gate, router_stats = fit_router(item.x, contribution, experts, params)
    return LayerPlan(shared, experts, gate, {k: round(v, 4) for k, v in (stats | router_stats).items()})


def activity(contribution: Tensor, fraction: float) -> Tensor:
    """contribution [N, I] -> active [N, I] bool: each token's top `fraction` of neurons by contribution."""
    top = max(1, round(fraction * contribution.shape[1]))
    active = torch.zeros_like(contribution, dtype=torch.bool)
    return active.scatter_(1, contribution.topk(top, dim=1).indices, True)


def split_neurons(active: Tensor, params: MoefyParams) -> tuple[Tensor, Tensor, dict[str, float]]:
    """active [N, I] -> (shared neuron ids [S], routed experts' neuron ids [E, width], stats)."""
    width = params.expert_width(active.shape[1])
    freq = active.float().mean(dim=0)  # [I]
    order = freq.argsort(descending=True)
    shared, routed = order[: params.shared].sort().values, order[params.shared :]
    labels = balanced_kmeans(active[:, routed].T.float(), params.experts, params.kmeans_iters, params.seed)
    experts = torch.stack([routed[labels == e].sort().values for e in range(params.experts)])  # [E, width]
    assert experts.shape == (params.experts, width)
    stats = {
        "shared_min_active_share": float(freq[shared].min()) if params.shared else 0.0,
        "routed_max_active_share": float(freq[routed].max()),
    }
    return shared, experts, stats


def fit_router(
    x: Tensor, contribution: Tensor, experts: Tensor, params: MoefyParams
) -> tuple[Tensor, dict[str, float]]:
    """The router [E, hidden] (see the module docstring, step 4), and how well it finds the important experts."""
    importance = contribution[:, experts].sum(dim=2)  # [N, E]
    gate = ridge_router(x, importance - importance.mean(dim=1, keepdim=True), params.ridge)  # [E, H]
    logits = x @ gate.T  # [N, E]
    gate = gate * (params.logit_std / logits.std(dim=1).median())
    chosen = logits.topk(params.top_k, dim=1).indices  # [N, k]
    oracle = importance.topk(params.top_k, dim=1).indices  # [N, k]
    recall = (chosen[:, :, None] == oracle[:, None, :]).any(dim=2).float().mean()
    stats = {
        "router_recall_of_oracle_topk": float(recall),
        "hot_share": hot_share(torch.bincount(chosen.flatten(), minlength=params.experts)),
    }
    return gate, stats


def ridge_router(x: Tensor, y: Tensor, ridge: float) -> Tensor:
    """Ridge regression of y [N, E] on x [N, H] without intercept, on standardised x -> router [E, H]."""
    scale = x.std(dim=0) + 1e-6  # [H]
    z = x / scale  # [N, H]
    gram = (z.T @ z).double()  # [H, H]
    gram += ridge * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype)
    w = torch.linalg.solve(gram, (z.T @ y).double()).float()  # [H, E]
    return (w / scale[:, None]).T.contiguous()


def moefied_layer(
    fmt: MoEFormat, dense: Checkpoint, layer: int, plan: LayerPlan, top_k: int, dtype: torch.dtype
) -> list[tuple[str, Tensor]]:
    """Router, shared expert (gate 0.5, down x 2) and routed experts (down x k), sliced from the dense FFN."""
    f = {x: dense.get(f"model.layers.{layer}.mlp.{x}_proj.weight", torch.float32) for x in ("gate", "up", "down")}

    def expert(idx: Tensor, down_scale: float) -> dict[str, Tensor]:
        return {"gate": f["gate"][idx], "up": f["up"][idx], "down": f["down"][:, idx] * down_scale}

    shared = expert(plan.shared, 2.0) | {"gate_logit": torch.zeros(1, f["gate"].shape[1])}
    tensors = [(fmt.router(layer), plan.gate)]
    tensors += [(name, shared[field]) for field, name in fmt.shared(layer).items()]
    for e, idx in enumerate(plan.experts):
        tensors += [(name, t) for name, t in zip(fmt.expert(layer, e).values(), expert(idx, top_k).values())]
    return [(name, t.to(dtype).contiguous()) for name, t in tensors]


def moefy(dense_dir: Path, out: Path, calibration: Calibration, params: MoefyParams) -> dict[str, object]:
    """Build the MoEfied Qwen2-MoE checkpoint at `out`; returns its provenance record."""
    started = time.monotonic()
    cfg, dense = open_dense(dense_dir)
    check_dense(cfg)
    width = params.expert_width(cfg.intermediate_size)
    check_disk(out, int(1.05 * sum(dense.nbytes(n) for n in dense.names())))
    fmt = MoEFormat("qwen2_moe")

    model = Transformer(dense, torch.float32)
    plans = {
        item.layer: plan_layer(item, params)
        for item in tqdm(ffn_inputs(model, calibration.token_ids), total=cfg.num_layers, desc="split FFNs")
    }
    del model
    calibrate_seconds = time.monotonic() - started

    dtype = dense.torch_dtype("model.layers.0.mlp.gate_proj.weight")
    dtype_name = str(dtype).split(".")[-1]
    config = moe_config(cfg, fmt, params.experts, params.top_k, width, params.shared, dtype_name)
    record: dict[str, object] = {
        "method": "MoEfication (Zhang et al. 2022), shared + routed: FFN neurons split into a shared expert (most "
        "often active) and balanced co-activation clusters; ridge-regression router on calibration statistics",
        "format": config.architectures[0],
        "parameters": asdict(params) | {"expert_intermediate_size": width, "norm_topk_prob": True},
        "source": source_record(Path(cfg.path)),
        "calibration": calibration.record(),
        "layer_stats": [plans[i].stats for i in range(cfg.num_layers)],
    }
    with staging(out) as tmp:
        record["checkpoint_bytes"], hashes = write_checkpoint(
            tmp,
            dense,
            cfg,
            lambda i: moefied_layer(fmt, dense, i, plans[i], params.top_k, dtype),
            config,
            desc="write experts",
        )
        record["calibrate_seconds"] = round(calibrate_seconds, 1)
        record["build_seconds"] = round(time.monotonic() - started, 1)
        write_provenance(tmp, record | {HASHES: hashes})
    return record
