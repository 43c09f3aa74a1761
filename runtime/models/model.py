"""`Transformer`: runs a checkpoint part by part (embed, per layer attention + ffn, logits) over a `KVCache`.

Weights are fetched through `_weights(key)`, the one place that decides residency: a part in `resident` is used
as is; otherwise, when a `fetch` hook is set (the offload pipeline sets one that returns the part from its ring
buffer slot), the hook provides it; otherwise it is loaded on first use and kept resident.

With `exact` every block computes each row as it would alone (runtime/models/linear.py `exact_rows`), so a row's
output does not depend on the batch, the tokens per pass or the drafter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..kv_cache import KVCache
from . import layers
from .checkpoint import Checkpoint
from .config import ModelConfig
from .linear import can_pack, exact_rows, pack_weights
from .validate import validate_checkpoint
from .weights import PartKey, WeightLoader, Weights

Tensor = torch.Tensor


@dataclass
class MoEPartial:
    """An MoE block between its routing and its combination: the routed tokens and the sum so far."""

    layer: int
    normed: Tensor  # [N, H]
    topk_ids: Tensor  # [N, k]
    topk_weights: Tensor  # [N, k]
    out: Tensor  # [N, H]: the experts added so far
    shared: Tensor | None  # [N, H]: the shared expert's output (Qwen2-MoE), added at the end
    packed: Tensor | None = None  # [B, T] bool: N counts only these (valid) tokens of hidden; None: N = B x T


def _rows_alone(method: Callable) -> Callable:
    """Run `method` inside `exact_rows()` when the model is exact (module docstring)."""
    @functools.wraps(method)
    def run(self: Transformer, *args, **kwargs):
        if not self.exact:
            return method(self, *args, **kwargs)
        with exact_rows():
            return method(self, *args, **kwargs)
    return run


class Transformer:
    """Layer-by-layer executor of a decoder-only LLM (runtime/models/config.py `SUPPORTED_ARCHITECTURES`)."""

    def __init__(
        self,
        path_or_checkpoint: str | Path | Checkpoint,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        packed: bool = False,
        exact: bool = False,
    ) -> None:
        path = path_or_checkpoint.path if isinstance(path_or_checkpoint, Checkpoint) else path_or_checkpoint
        self.config = ModelConfig.from_dir(path)  # first: a bad config.json is the clearer error
        checkpoint = path_or_checkpoint
        if not isinstance(checkpoint, Checkpoint):
            checkpoint = Checkpoint(path)
        validate_checkpoint(checkpoint, self.config)  # every tensor against the config, before any allocation
        self.dtype = dtype
        self.device = torch.device(device)
        self.exact = exact  # each row computed as it would be alone (module docstring)
        self.loader = WeightLoader(checkpoint, self.config, dtype, self.device)
        self.loader.packed = packed  # compressed weights a kernel takes stay packed when loaded (weights.py)
        self.rope = layers.Rope.from_config(self.config, self.device)
        self.resident: dict[PartKey, Weights] = {}
        #: provider of non-resident parts (a list of keys -> their weights), or None to load and keep them
        self.fetch: Callable[[list[PartKey]], dict[PartKey, Weights]] | None = None
        #: keep linear weights in oneDNN's packed layout (float32 on CPU; faster GEMV/GEMM, see linear.py)
        self.pack = can_pack(dtype, self.device)
        #: observer of MoE routing: called with (layer, topk_ids [N, k] of the valid tokens) after each route
        self.on_route: Callable[[int, Tensor], None] | None = None
        #: embeds input ids instead of the embedding part (e.g. another worker's on-demand embedding rows)
        self.embedder: Callable[[Tensor], Tensor] | None = None

    def preload(self, keys: Iterable[PartKey] | None = None) -> None:
        """Make these parts (default: all) resident now, so the first forward pays no loading."""
        for key in self.loader.parts() if keys is None else keys:
            if key not in self.resident:
                self.resident[key] = self._load(key)

    def new_cache(self, batch_size: int, capacity: int, growable: bool = True) -> KVCache:
        cfg = self.config
        kv_heads, head_dim = cfg.cache_geometry
        return KVCache(cfg.num_layers, batch_size, kv_heads, head_dim, capacity, self.dtype, self.device, growable)

    @torch.inference_mode()
    def embed(self, input_ids: Tensor) -> Tensor:
        """input_ids [B, T] -> hidden [B, T, H]."""
        if self.embedder is not None:
            return self.embedder(input_ids)
        return layers.embed(self._weights(PartKey("embedding")), input_ids.to(self.device))

    @_rows_alone
    @torch.inference_mode()
    def attention(self, layer: int, hidden: Tensor, cache: KVCache, token_mask: Tensor | None = None) -> Tensor:
        """Attention block of `layer` (writes K/V, does not advance the cache): [B, T, H] -> [B, T, H];
        token_mask [B, T] marks valid tokens (projections on those only, layers.attention_forward)."""
        w = self._weights(PartKey("attention", layer))
        forward = layers.mla_attention_forward if self.config.mla else layers.attention_forward
        return forward(self.config, w, hidden, cache, layer, self.rope, token_mask)

    @_rows_alone
    @torch.inference_mode()
    def ffn(self, layer: int, hidden: Tensor, token_mask: Tensor | None = None,
            allowed: Tensor | None = None) -> Tensor:
        """FFN block of `layer`: [B, T, H] -> [B, T, H]. For MoE, loads only the experts valid tokens select.

        token_mask [B, T] bool marks valid tokens; padded tokens then select no expert, and a dense MLP runs on
        the valid tokens only (a prefill pads every row to the batch's longest prompt; docs/perf/README.md
        prefill_padding); a padded position keeps its input (junk no valid token reads: right padding, causal).
        allowed [E] bool: route among these experts only (see layers.route).
        """
        if not self.config.is_moe_layer(layer):
            weights = self._weights(PartKey("dense_mlp", layer))
            mask = layers.padding_mask(token_mask, hidden.device)  # [B, T] or None
            if mask is None:
                return layers.dense_mlp_forward(self.config, weights, hidden)
            out = hidden.clone()
            out[mask] = layers.dense_mlp_forward(self.config, weights, hidden[mask])  # [n valid, H]
            return out
        state = self.moe_route(layer, hidden, token_mask, allowed)
        self.moe_experts(state, range(self.config.num_experts))
        return self.moe_finish(state, hidden)

    # An MoE block in parts, for experts that arrive in groups (runtime/offload: a ring slot per expert group):
    # route (and the shared expert) once, add each group's experts in order, then combine. The additions happen
    # in the same order as in one `ffn` call, so the result is the same, bit for bit.
    @_rows_alone
    def moe_route(self, layer: int, hidden: Tensor, token_mask: Tensor | None = None,
                  allowed: Tensor | None = None) -> MoEPartial:
        """Routing of `layer` for hidden [B, T, H] (and its shared expert's output, Qwen2-MoE). With a token_mask
        that pads some positions, routing, the shared expert and the experts run on the valid tokens only."""
        router = self._weights(PartKey("router", layer))
        packed = layers.padding_mask(token_mask, hidden.device)  # [B, T] or None
        if packed is not None:
            hidden = hidden[packed]  # [n valid, H]: from here every token is valid
        normed, topk_ids, topk_weights = layers.route(self.config, router, hidden, allowed)
        if self.on_route is not None:
            self.on_route(layer, topk_ids)
        shared = layers.shared_expert_forward(self.config, router, normed) if router.shared_expert is not None else None
        return MoEPartial(layer, normed, topk_ids, topk_weights, torch.zeros_like(normed), shared, packed)

    @_rows_alone
    def moe_experts(self, state: MoEPartial, experts: range) -> None:
        """Add the outputs of the experts in `experts` that some valid token selected (loads only those)."""
        chosen = [e for e in layers.selected_experts(state.topk_ids) if e in experts]
        keys = [PartKey("expert", state.layer, e) for e in chosen]
        weights = {key.expert: w for key, w in self._weights_many(keys).items()}
        layers.experts_forward(self.config, state.normed, state.topk_ids, state.topk_weights, weights,
                               out=state.out, only=experts)

    @staticmethod
    def moe_finish(state: MoEPartial, hidden: Tensor) -> Tensor:
        """Experts (+ shared expert) + residual: hidden [B, T, H] -> [B, T, H] (padded positions, when the block
        ran packed, keep their input)."""
        out = state.out if state.shared is None else state.out + state.shared  # [N, H]
        if state.packed is None:
            return hidden + out.view(hidden.shape)
        result = hidden.clone()
        result[state.packed] = hidden[state.packed] + out
        return result

    @_rows_alone
    @torch.inference_mode()
    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [B, T, H] -> logits [B, T, V] float32."""
        return layers.head_logits(self.config, self._weights(PartKey("head")), hidden)

    @_rows_alone
    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,
        cache: KVCache,
        num_new: Tensor | None = None,
        output_positions: Tensor | None = None,
        compute_logits: bool = True,
        allowed_experts: dict[int, Tensor] | None = None,
    ) -> Tensor | None:
        """Run all layers on input_ids [B, T] and advance the cache by num_new [B] (default T per row).

        Row b's tokens t >= num_new[b] are padding: they are written past the row's valid length (and later
        overwritten), route to no expert, and their logits are junk. Returns logits [B, T, V] float32, or only
        at output_positions [B, P] (indices into T) -> [B, P, V], or None if not compute_logits.
        allowed_experts: layer -> [E] bool, the experts each MoE layer may route to (default: all).
        """
        batch, steps = input_ids.shape
        token_mask = None
        if num_new is not None:
            num_new = torch.as_tensor(num_new, dtype=torch.long).cpu()
            token_mask = torch.arange(steps)[None, :] < num_new[:, None]  # [B, T]
            token_mask = token_mask.to(self.device)
        hidden = self.embed(input_ids)  # [B, T, H]
        for layer in range(self.config.num_layers):
            hidden = self.attention(layer, hidden, cache, token_mask)
            allowed = allowed_experts.get(layer) if allowed_experts is not None else None
            hidden = self.ffn(layer, hidden, token_mask, allowed)
        cache.advance(num_new if num_new is not None else steps)
        if not compute_logits:
            return None
        if output_positions is not None:
            index = torch.as_tensor(output_positions, dtype=torch.long, device=self.device)  # [B, P]
            hidden = torch.gather(hidden, 1, index[:, :, None].expand(-1, -1, hidden.shape[-1]))  # [B, P, H]
        return self.logits(hidden)  # [B, T or P, V]

    __call__ = forward

    def _weights(self, key: PartKey) -> Weights:
        """The single residency decision (see the module docstring)."""
        return self._weights_many([key])[key]

    def _weights_many(self, keys: list[PartKey]) -> dict[PartKey, Weights]:
        out = {key: self.resident[key] for key in keys if key in self.resident}
        missing = [key for key in keys if key not in out]
        if missing and self.fetch is not None:
            out |= self.fetch(missing)
        else:
            for key in missing:
                out[key] = self.resident[key] = self._load(key)
        return out

    def _load(self, key: PartKey) -> Weights:
        weights = self.loader.load(key)
        if self.pack and key.kind != "embedding":
            weights = pack_weights(weights)
        return weights
