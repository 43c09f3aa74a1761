"""How close an MoE checkpoint is to its dense source, and how its router spreads tokens.

* Top-1 agreement: teacher-forced on the same prompts, the share of positions where the MoE model's argmax
  next token equals the dense model's.
* Expert hotness per layer: share of routed (token, slot) pairs that go to the hottest 25% of experts
  (0.25 = perfectly balanced).
* Greedy identity: the dense model's own greedy continuation (incremental decoding with a KV cache); the MoE
  model, fed prompt + continuation in one pass, must predict every continuation token. By induction its
  greedy output then equals the dense model's token for token. Logits are compared on the same pass.

Models run layer-major over the whole batch (`Transformer` public methods); a model too big for RAM in float32
keeps its non-expert parts resident and reads the experts its router selects per layer, dropping them after.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specoffload.runtime.models import layers
from specoffload.runtime.models.model import Transformer

from .stats import hot_share

Tensor = torch.Tensor
#: float32 models larger than this stream their experts instead of keeping them resident
RESIDENT_LIMIT = 8 << 30


@dataclass(frozen=True)
class Batch:
    """Right-padded token rows."""

    token_ids: Tensor  # [B, T] long, 0 past each row's length
    lengths: Tensor  # [B] long

    @classmethod
    def of(cls, rows: list[list[int]]) -> Batch:
        steps = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), steps, dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, : len(row)] = torch.tensor(row)
        return cls(ids, torch.tensor([len(r) for r in rows]))

    @property
    def valid(self) -> Tensor:
        return torch.arange(self.token_ids.shape[1])[None, :] < self.lengths[:, None]  # [B, T] bool


@dataclass(frozen=True)
class Predictions:
    """Per valid position (row-major over the batch): argmax, top-1 minus top-2 logit, optionally logits."""

    top1: Tensor  # [M] long
    margin: Tensor  # [M] float32
    logits: Tensor | None  # [M', V] float32 at the positions asked for, else None
    routing: Tensor | None  # [layers, E] routed (token, slot) counts, None for a dense model


def load_model(path: Path) -> Transformer:
    """A float32 executor; experts stream from disk if the model would not fit RESIDENT_LIMIT."""
    model = Transformer(path, torch.float32)
    if model.config.is_moe and model.loader.total_nbytes() > RESIDENT_LIMIT:
        model.preload([k for k in model.loader.parts() if k.kind != "expert"])
        model.fetch = lambda keys: {k: model.loader.load(k) for k in keys}
    return model


@torch.inference_mode()
def predict(model: Transformer, batch: Batch, keep_logits: Tensor | None = None, chunk: int = 256) -> Predictions:
    """Run `batch` through `model`; keep_logits [B, T] bool marks the positions whose logits to return."""
    cfg = model.config
    valid = batch.valid  # [B, T]
    routing = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.long) if cfg.is_moe else None
    cache = model.new_cache(*batch.token_ids.shape)
    hidden = model.embed(batch.token_ids)  # [B, T, H]
    for layer in range(cfg.num_layers):
        hidden = model.attention(layer, hidden, cache)
        if routing is not None and cfg.is_moe_layer(layer):
            _, topk_ids, _ = layers.route(cfg, model.loader.router(layer), hidden)  # [N, k]
            routing[layer] = torch.bincount(topk_ids[valid.flatten()].flatten(), minlength=cfg.num_experts)
        hidden = model.ffn(layer, hidden, valid)
    flat = hidden[valid]  # [M, H]
    keep = None if keep_logits is None else keep_logits[valid]  # [M]
    top1, margin, kept = [], [], []
    for start in range(0, flat.shape[0], chunk):
        logits = model.logits(flat[None, start : start + chunk])[0]  # [m, V]
        top2 = logits.topk(2, dim=-1).values  # [m, 2]
        top1.append(logits.argmax(dim=-1))
        margin.append(top2[:, 0] - top2[:, 1])
        if keep is not None:
            kept.append(logits[keep[start : start + chunk]])
    return Predictions(torch.cat(top1), torch.cat(margin), torch.cat(kept) if kept else None, routing)


def routing_report(routing: Tensor, moe_layers: list[int]) -> dict[str, object]:
    per_layer = [round(hot_share(routing[i]), 4) for i in moe_layers]
    return {
        "hot_share_per_layer": per_layer,
        "hot_share_mean": round(sum(per_layer) / len(per_layer), 4),
        "load_per_layer": [(routing[i] / routing[i].sum()).round(decimals=4).tolist() for i in moe_layers],
    }


@dataclass(frozen=True)
class Reference:
    """The dense model's side of a comparison, computed first so the dense model can be freed before the MoE's."""

    batch: Batch
    predictions: Predictions
    continuations: list[list[int]] | None = None  # greedy check: the dense model's own continuations
    checked: Tensor | None = None  # [B, T] bool: positions predicting a continuation token


def agreement_reference(dense: Transformer, rows: list[list[int]]) -> Reference:
    batch = Batch.of(rows)
    return Reference(batch, predict(dense, batch))


def agreement(moe: Transformer, ref: Reference) -> dict[str, object]:
    """Teacher-forced top-1 agreement over every position of the reference rows, and the MoE's expert hotness."""
    got = predict(moe, ref.batch)
    same = ref.predictions.top1 == got.top1  # [M]
    last = ref.batch.lengths.cumsum(0) - 1  # [B] flat index of each row's last position
    return {
        "prompts": len(ref.batch.lengths),
        "positions": int(same.numel()),
        "top1_agreement": round(float(same.float().mean()), 4),
        "next_token_agreement": round(float(same[last].float().mean()), 4),  # the first token generated
    } | routing_report(got.routing, sorted(moe.config.moe_layers))


@torch.inference_mode()
def dense_greedy(model: Transformer, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation with incremental decoding (prefill, then one token per step)."""
    cache = model.new_cache(1, len(prompt) + new_tokens)
    logits = model(torch.tensor([prompt]), cache, output_positions=[[len(prompt) - 1]])  # [1, 1, V]
    out = [int(logits[0, -1].argmax())]
    while len(out) < new_tokens:
        out.append(int(model(torch.tensor([[out[-1]]]), cache)[0, -1].argmax()))
    return out


def greedy_reference(dense: Transformer, prompts: list[list[int]], new_tokens: int) -> Reference:
    """The dense greedy continuations, and the dense logits on prompt + continuation at the checked positions."""
    conts = [dense_greedy(dense, p, new_tokens) for p in prompts]
    batch = Batch.of([p + c[:-1] for p, c in zip(prompts, conts)])
    checked = torch.zeros_like(batch.token_ids, dtype=torch.bool)  # [B, T]
    for b, p in enumerate(prompts):
        checked[b, len(p) - 1 : len(p) - 1 + new_tokens] = True
    return Reference(batch, predict(dense, batch, checked), conts, checked)


def greedy_identity(moe: Transformer, ref: Reference) -> dict[str, object]:
    """Does the MoE model predict the dense model's greedy continuation at every step? With logit errors."""
    assert ref.continuations is not None and ref.checked is not None
    got = predict(moe, ref.batch, ref.checked)
    pick = ref.checked[ref.batch.valid]  # [M]
    expected = torch.tensor([t for c in ref.continuations for t in c])  # [B * new_tokens]
    new_tokens = len(ref.continuations[0])
    rows = []
    for b, cont in enumerate(ref.continuations):
        hits = got.top1[pick][b * new_tokens : (b + 1) * new_tokens] == expected[b * new_tokens : (b + 1) * new_tokens]
        mismatch = (~hits).nonzero()
        first = int(mismatch[0]) if len(mismatch) else None
        rows.append({"identical": bool(hits.all()), "first_mismatch": first, "dense_tokens": cont})
    diff = (got.logits - ref.predictions.logits).abs()
    return {
        "prompts": len(rows),
        "new_tokens": new_tokens,
        "all_identical": all(r["identical"] for r in rows),
        "dense_prefill_matches_decode": bool((ref.predictions.top1[pick] == expected).all()),
        "max_abs_logit_diff": float(diff.max()),
        "max_rel_logit_diff": float(diff.max() / ref.predictions.logits.abs().max()),
        "min_dense_margin": float(ref.predictions.margin[pick].min()),
        "rows": rows,
    } | routing_report(got.routing, sorted(moe.config.moe_layers))
