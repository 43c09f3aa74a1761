"""Sparse upcycling (Komatsuzaki et al. 2022, "Sparse Upcycling: Training Mixture-of-Experts from Dense
Checkpoints"): every expert of layer i is a copy of dense layer i's FFN, so with renormalised top-k weights
(which sum to 1) the MoE layer computes

    sum_{e in topk(x)} w_e(x) FFN(x) = FFN(x)

and the model's output is the dense model's, up to float rounding (in float32 the weights sum to 1 within an
ulp; with top-1 the weight is p / p = 1 exactly). Each copy is stored as its own tensors (no deduplication):
the bytes on disk and streamed per pass are those of a real E-expert model.

The router is not random. Per layer, the FFN inputs of calibration text are scaled per dimension by their
standard deviation (a diagonal rescale a bias-free linear router can absorb, so no outlier dimension decides
alone) and clustered by spherical k-means; the E unit centroids, mapped back, are the router rows, so a token
goes to the experts whose centroids it points at most. Routing is data-dependent and as skewed as the
clusters. A single temperature per layer sets the logits' median per-token spread across experts to
`logit_std`; it changes the softmax weights, not the top-k choice.
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
from .calibration import Calibration, ffn_inputs
from .errors import MoEBuildError
from .formats import MoEFormat, moe_config, upcycle_format
from .kmeans import spherical_kmeans
from .shards import HASHES, source_record, write_provenance
from .stats import hot_share

Tensor = torch.Tensor


@dataclass(frozen=True)
class UpcycleParams:
    experts: int = 8
    top_k: int = 2
    logit_std: float = 1.0  # median over tokens of the std of the router logits across experts
    kmeans_iters: int = 30
    seed: int = 0

    def check(self) -> None:
        if self.experts < 2:
            raise MoEBuildError(f"--experts must be at least 2, got {self.experts}")
        if not 1 <= self.top_k <= self.experts:
            raise MoEBuildError(f"--top-k must be in 1..{self.experts} (--experts), got {self.top_k}")


@dataclass(frozen=True)
class Router:
    gate: Tensor  # [experts, hidden] float32: logits = gate @ x
    cluster_share: tuple[float, ...]  # share of calibration tokens whose top-1 expert is e
    hot_share: float  # share of calibration (token, slot) routings that go to the hottest 25% of experts


def fit_router(x: Tensor, params: UpcycleParams) -> Router:
    """x [tokens, hidden] FFN inputs -> a router whose top-1 expert is the token's k-means cluster."""
    scale = x.std(dim=0) + 1e-6  # [H]
    centroids, _ = spherical_kmeans(x / scale, params.experts, params.kmeans_iters, params.seed)  # [E, H]
    gate = centroids / scale  # logits = (x / scale) . c = x . (c / scale)
    logits = x @ gate.T  # [N, E]
    gate = gate * (params.logit_std / logits.std(dim=1).median())
    top1 = torch.bincount(logits.argmax(dim=1), minlength=params.experts).float()  # [E]
    topk = logits.topk(params.top_k, dim=1).indices  # [N, k]
    share = tuple(round(v, 4) for v in (top1 / top1.sum()).tolist())
    return Router(gate, share, hot_share(torch.bincount(topk.flatten(), minlength=params.experts)))


def upcycle(dense_dir: Path, out: Path, calibration: Calibration, params: UpcycleParams) -> dict[str, object]:
    """Build the upcycled checkpoint at `out`; returns its provenance record."""
    params.check()
    started = time.monotonic()
    cfg, dense = open_dense(dense_dir)
    fmt = upcycle_format(cfg)
    ffn = [f"model.layers.{i}.mlp.{x}_proj.weight" for i in range(cfg.num_layers) for x in ("gate", "up", "down")]
    extra = (params.experts - 1) * sum(dense.nbytes(n) for n in ffn)
    check_disk(out, int(1.02 * (sum(dense.nbytes(n) for n in dense.names()) + extra)))

    model = Transformer(dense, torch.float32)
    routers = {
        item.layer: fit_router(item.x, params)
        for item in tqdm(ffn_inputs(model, calibration.token_ids), total=cfg.num_layers, desc="calibrate routers")
    }
    del model
    calibrate_seconds = time.monotonic() - started

    dtype = dense.torch_dtype(ffn[0])
    config = moe_config(cfg, fmt, params.experts, params.top_k, cfg.intermediate_size, 0, str(dtype).split(".")[-1])
    record: dict[str, object] = {
        "method": "sparse upcycling (Komatsuzaki et al. 2022): every expert a copy of the dense FFN, top-k weights "
        "renormalised; router rows = spherical k-means centroids of per-dimension-standardised FFN inputs",
        "format": config.architectures[0],
        "parameters": asdict(params) | {"norm_topk_prob": True, "shared_expert_intermediate_size": 0},
        "source": source_record(Path(cfg.path)),
        "calibration": calibration.record(),
        "router_calibration": {
            "hot_share_per_layer": [round(routers[i].hot_share, 4) for i in range(cfg.num_layers)],
            "top1_share_per_layer": [routers[i].cluster_share for i in range(cfg.num_layers)],
        },
    }
    with staging(out) as tmp:
        record["checkpoint_bytes"], hashes = write_checkpoint(
            tmp,
            dense,
            cfg,
            lambda i: upcycled_layer(fmt, dense, i, routers[i].gate.to(dtype), params.experts),
            config,
            desc=f"write {params.experts} experts/layer",
        )
        record["calibrate_seconds"] = round(calibrate_seconds, 1)
        record["build_seconds"] = round(time.monotonic() - started, 1)
        write_provenance(tmp, record | {HASHES: hashes})
    return record


def upcycled_layer(
    fmt: MoEFormat, dense: Checkpoint, layer: int, gate: Tensor, experts: int
) -> list[tuple[str, Tensor]]:
    """The MoE block of one layer: router, (Qwen2-MoE) an empty shared expert, and `experts` FFN copies.

    The copies are the same tensors named `experts` times; `write_shard` writes each as its own bytes.
    """
    ffn = {x: dense.get(f"model.layers.{layer}.mlp.{x}_proj.weight") for x in ("gate", "up", "down")}
    tensors = [(fmt.router(layer), gate)]
    if fmt.family == "qwen2_moe":  # shared_expert_intermediate_size 0: the shared expert adds exactly 0
        hidden = gate.shape[1]
        empty = {"gate": (0, hidden), "up": (0, hidden), "down": (hidden, 0), "gate_logit": (1, hidden)}
        tensors += [(name, torch.zeros(empty[f], dtype=gate.dtype)) for f, name in fmt.shared(layer).items()]
    for e in range(experts):
        tensors += [(name, ffn[f]) for f, name in fmt.expert(layer, e).items()]
    return tensors
