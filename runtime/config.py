"""User-facing engine configuration."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specoffload.planner.units import MemorySizeError, machine_memory_bytes, parse_bytes

from .errors import ConfigError
from .models.gguf import gguf_file_in, resolve_model
from .offload.drafters import check_options, drafter_named
from .param_ranges import MAX_LOGPROBS

__all__ = ["ConfigError", "EngineConfig"]

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: dtype "auto": the checkpoint's dtype where the device computes in it well; on the CPU float16 weights compute in
#: float32 (exact upcast: the CPU has no fast float16 matmul), bfloat16 ones in bfloat16
_AUTO_ON_CPU = {"float16": "float32", "bfloat16": "bfloat16", "float32": "float32"}


def checkpoint_dtype(path: str | Path) -> str | None:
    """The dtype a checkpoint's config.json names (`dtype`, or the older `torch_dtype`), if one this engine runs."""
    import json

    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("dtype") or config.get("torch_dtype")
    return name if name in _DTYPES else None


def resolve_dtype(dtype: str, path: str | Path, device: str = "cpu") -> str:
    """A concrete dtype name for `dtype` ("auto": from the checkpoint, see _AUTO_ON_CPU; float32 when it names
    none)."""
    if dtype != "auto":
        return dtype
    found = checkpoint_dtype(path) or "float32"
    return _AUTO_ON_CPU[found] if torch.device(device).type == "cpu" else found


@dataclass(frozen=True)
class EngineConfig:
    """What to run and how.

    target: HF checkpoint directory of the model whose output we reproduce ("~" is expanded, as for draft).
    draft: checkpoint directory of a small model on the same vocabulary (the "model" drafter's); "self": the same as
        drafter="self"; None: no checkpoint.
    drafter: who proposes the draft tokens, a name in the drafter registry (runtime/offload/drafters.py
        `DRAFTERS`): "none" (plain decoding), "model" (the draft checkpoint), "self" (an MoE target, offloaded,
        drafts for itself with only its resident experts), "lowbit" (the target, offloaded, drafts for itself with
        int4 / int8 copies of the parts it streams), "ngram", "suffix", or any registered one. None: from `draft`
        (None -> "none", "self" -> "self", a checkpoint directory -> "model"); `drafter_name` is the resolved name.
    dtype: compute dtype: "float32" (default), "bfloat16", "float16" or "auto" (the checkpoint's; on the CPU a
        float16 checkpoint computes in float32). draft_dtype: the draft's (None: dtype).
    num_draft_tokens: k, tokens the draft proposes per verification step (0 = no speculation: the draft is not
        loaded; unused without a draft), or "auto" (offloaded only, and its default): the planner picks k
        (0 included) from the measured hardware profile and re-plans it online from the observed acceptance rate.
    max_batch_size: rows decoded together; finished rows are refilled from waiting prompts; "auto" (offloaded
        only, and its default): the planner picks it under the memory budget. Resident default: 16.
    num_threads: torch intra-op threads (None: leave torch's default, one per core).
    device: "cpu" (default), "cuda[:N]" or "auto" (cuda when torch sees a GPU). On CUDA every weight is resident
        on the GPU, or, offloaded, the target's FFN / experts, head and resident parts and the draft run on the GPU
        while its embedding, attention and KV cache stay on the CPU (the paper's design; `host_attention`), the
        streamed weights crossing PCIe on a copy stream (runtime/offload/slot_sync.py).

    Offloading (the target streams its weights; see runtime/offload/). Setting `device_memory` turns it on:
    device_memory: bytes (or "4GiB", "512MiB", ...) the engine may keep resident where compute happens: the draft
        model and its KV cache, the target's resident parts and the ring of weight buffers. On "cpu" the device
        *is* host memory, so unless host_memory is given the target's KV cache (and a "ram" weights tier) count
        against it too: one budget for everything the engine holds.
    host_memory: bytes of host RAM for the target KV cache (CPU attention) and, with weights_tier "ram", the
        streamed weights (default: the machine's memory; on "cpu", giving it splits the budget in two).
    weights_tier: where the target's streamed weights live: "disk" (read from the safetensors files with direct
        I/O, so a warm page cache cannot fake the result) or "ram" (host memory, pinned on CUDA).
    num_buffers: ring slots of streamed layer weights (>= 1; 2 overlaps loading layer j+1 with computing j).
    max_seq_len: longest prompt + output per row the KV caches are sized for (default: the target's context,
        at most 4096); placement counts the KV caches at this length.
    acceptance_prior: the draft's per-token acceptance rate the planner assumes before it has observed any.
    replan_interval: with k "auto", re-estimate the acceptance rate and re-plan k every this many verify rounds.
    expert_loading: MoE only: "selected" loads only the experts the router picks for the batch, "all" loads
        every expert of a layer ahead of use, "auto" picks by the expected number of distinct experts.
    expert_group: MoE only: experts per ring slot of a streamed MoE layer (None: a whole layer per slot); the
        ffn then runs one group after another, so the ring holds a group, not a layer (smaller by up to E / g).
    packed_weights: a compressed target's weights (int8, int4, a GGUF's q4_0 / q4_k): "auto" keeps them packed
        where the layers multiply by them faster than they can be dequantized (bfloat16 compute on a CPU with
        native bfloat16 GEMMs, runtime/models/packed.py), in the ring slots and, under a device_memory budget, for
        resident parts too (which then take their packed bytes of the budget); "on" does both on any CPU, budget
        or not; "slots" packs only the streamed weights (resident parts dequantized at load); "off" always
        dequantizes.
    trace: record a timed span per pipeline operation (for `Engine.tracer`).
    exact: True: the target computes each row as it would alone (runtime/models/linear.py `exact_rows`: every
        GEMM in blocks of a fixed row count, attention per query over exactly its keys), so a row's output does not
        depend on the batch, the tokens of a pass, refills or the drafter: greedy speculative output is the
        no-draft output token for token in bfloat16 too, not only in float32. It costs compute (README, "What
        lossless means"): 0.56x resident, 0.93x at a tight budget (docs/perf `exact_cost`), so it is off by
        default. "auto" turns it on only where the planned pass waits on its reads long enough to hide that
        (offloaded, with a profile: engine.py `EXACT_COMPUTE`); the Engine's config then holds the choice.
    kv_block_size: offloaded: the target's KV caches hold blocks of this many positions from one pool of the
        attention worker, sized by the placement (runtime/kv_blocks.py): a row holds the blocks its tokens use, not
        a reservation for prompt + max_new_tokens; 0: one contiguous cache per batch, reserved for its longest row.

    interleave: offloaded with a drafter, True: two batches alternate, the drafter proposing for one while the target
        verifies the other (its steps hidden behind the pass); False: one batch drafts for itself between its own
        passes (the KV caches of one batch instead of two); "auto": the planner chooses. None (the default): False
        for a model-free drafter (its proposals cost microseconds: nothing to hide), else True. Resident (nothing
        streams for a draft to hide behind) the plan runs one batch.

    drafter_options: the drafters' settings by name (each drafter's `options` dataclass, runtime/offload/drafters/:
        "prompt_lookup_min" / "prompt_lookup_max" of "ngram", "suffix_max_depth" / "suffix_min_prob" /
        "suffix_spec_factor" of "suffix", "resident_experts" / "migrate_interval" of "self", ...); an unknown name or
        a bad value is a ConfigError. Unnamed settings keep their drafter's defaults.

    max_logprobs: the most log-probabilities per token a request may ask for (`SamplingParams.logprobs`; vLLM's
        engine argument, with its default 20): a larger ask is refused, not answered with the whole vocabulary.

    Continuous batching (offloaded; runtime/offload/batches.py):
    refill: a finished row's slot takes a waiting prompt at once, prefilled inside its batch's next streamed pass
        beside the other rows' decode tokens (False: a batch waits for its slowest row, then takes a new wave).
    prefill_chunk: prompt tokens any streamed pass feeds at most (a longer prompt continues over the batch's next
        passes, so one long prompt does not stall the rows decoding beside it, and a pass's activations stay
        bounded); None: the planner's budget (`Plan.prefill_chunk`), which paces prompts beside decoding rows only
        (runtime/offload/batches.py `PromptBudget`).
    """

    target: str | Path
    draft: str | Path | None = None
    dtype: str = "float32"
    draft_dtype: str | None = None
    num_draft_tokens: int | str | None = None
    max_batch_size: int | str | None = None
    device: str = "cpu"
    num_threads: int | None = None
    device_memory: int | str | None = None
    host_memory: int | str | None = None
    weights_tier: str = "disk"
    num_buffers: int = 2
    max_seq_len: int | None = None
    expert_loading: str = "auto"
    expert_group: int | None = None
    packed_weights: str = "auto"
    trace: bool = False
    exact: bool | str = False
    acceptance_prior: float = 0.7
    replan_interval: int = 8
    interleave: bool | str | None = None
    refill: bool = True
    prefill_chunk: int | None = None
    drafter: str | None = None
    kv_block_size: int = 0
    drafter_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    max_logprobs: int = MAX_LOGPROBS

    def __post_init__(self) -> None:
        if self.device == "auto":
            object.__setattr__(self, "device", "cuda" if torch.cuda.is_available() else "cpu")
        try:
            kind = torch.device(self.device).type
        except (RuntimeError, TypeError):
            kind = None
        if kind not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu', 'cuda[:N]' or 'auto', got {self.device!r}")
        for name in ("target", "draft"):  # "~/models/x" as a shell would read it
            value = getattr(self, name)
            if isinstance(value, (str, Path)) and str(value).startswith("~"):
                value = type(value)(os.path.expanduser(str(value)))
                object.__setattr__(self, name, value)
            if isinstance(value, (str, Path)) and value != "self" and gguf_file_in(value) is not None:
                object.__setattr__(self, name, type(value)(resolve_model(value)))  # a GGUF: its companion directory
        if self.dtype not in (*_DTYPES, "auto"):
            raise ConfigError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {self.dtype!r}")
        if self.draft_dtype is not None and self.draft_dtype not in (*_DTYPES, "auto"):
            raise ConfigError(f"draft_dtype must be one of {sorted(_DTYPES)}, 'auto' or None, "
                              f"got {self.draft_dtype!r}")
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.target, self.device))
        if self.draft_dtype == "auto":
            draft = self.draft if self.draft not in (None, "self") else self.target
            object.__setattr__(self, "draft_dtype", resolve_dtype("auto", draft, self.device))
        # Defaults: the planner's choice when offloaded (device_memory set), else k = 4 and 16 rows.
        if self.num_draft_tokens is None:
            object.__setattr__(self, "num_draft_tokens", "auto" if self.device_memory is not None else 4)
        if self.max_batch_size is None:
            object.__setattr__(self, "max_batch_size", "auto" if self.device_memory is not None else 16)
        k, batch = self.num_draft_tokens, self.max_batch_size
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ConfigError(f"num_draft_tokens (k) must be an integer >= 0 (0: no speculation) or 'auto', got {k!r}")
        if batch != "auto" and (not isinstance(batch, int) or batch < 1):
            raise ConfigError(f"max_batch_size must be an integer >= 1 or 'auto', got {batch!r}")
        if "auto" in (k, batch) and self.device_memory is None:
            raise ConfigError("'auto' batch size or k needs device_memory: the planner plans for an offloaded target")
        if not 0.0 <= self.acceptance_prior <= 1.0:
            raise ConfigError(f"acceptance_prior must be in [0, 1], got {self.acceptance_prior!r}")
        if not isinstance(self.replan_interval, int) or self.replan_interval < 0:
            raise ConfigError(f"replan_interval must be an integer >= 0, got {self.replan_interval!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be >= 1, got {self.num_threads!r}")
        for name in ("device_memory", "host_memory"):
            value = getattr(self, name)
            if value is not None:
                try:
                    object.__setattr__(self, name, parse_bytes(value))
                except MemorySizeError as exc:
                    raise ConfigError(f"{name}: {exc}") from None
        if self.weights_tier not in ("disk", "ram"):
            raise ConfigError(f"weights_tier must be 'disk' or 'ram', got {self.weights_tier!r}")
        if not isinstance(self.num_buffers, int) or self.num_buffers < 1:
            raise ConfigError(f"num_buffers must be an integer >= 1, got {self.num_buffers!r}")
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len < 2):
            raise ConfigError(f"max_seq_len must be an integer >= 2, got {self.max_seq_len!r}")
        if not isinstance(self.drafter_options, Mapping):
            raise ConfigError(f"drafter_options must be a mapping of option names to values, got "
                              f"{self.drafter_options!r}")
        object.__setattr__(self, "drafter_options", dict(self.drafter_options))  # (a copy: picklable for Ray)
        check_options(self.drafter_options)  # names and values, as their drafters' options check them
        self._check_drafter()
        if self.interleave is None:
            object.__setattr__(self, "interleave", not self.drafter_class.model_free)
        if self.interleave not in (True, False, "auto"):
            raise ConfigError(f"interleave must be True, False or 'auto', got {self.interleave!r}")
        if self.expert_group is not None and (isinstance(self.expert_group, bool)
                                              or not isinstance(self.expert_group, int) or self.expert_group < 1):
            raise ConfigError(f"expert_group must be an integer >= 1 (experts per slot), got {self.expert_group!r}")
        if not isinstance(self.exact, bool) and self.exact != "auto":
            raise ConfigError(f"exact must be True, False or 'auto', got {self.exact!r}")
        if not isinstance(self.refill, bool):
            raise ConfigError(f"refill must be True or False, got {self.refill!r}")
        if self.prefill_chunk is not None and (isinstance(self.prefill_chunk, bool)
                                               or not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 1):
            raise ConfigError(f"prefill_chunk must be an integer >= 1 (prompt tokens per pass) or None, "
                              f"got {self.prefill_chunk!r}")
        if isinstance(self.kv_block_size, bool) or not isinstance(self.kv_block_size, int) or self.kv_block_size < 0:
            raise ConfigError(f"kv_block_size must be an integer >= 0 (0: contiguous KV caches), "
                              f"got {self.kv_block_size!r}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ConfigError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        if self.expert_loading not in ("auto", "selected", "all"):
            raise ConfigError(f"expert_loading must be 'auto', 'selected' or 'all', got {self.expert_loading!r}")
        if self.packed_weights not in ("auto", "on", "slots", "off"):
            raise ConfigError(f"packed_weights must be 'auto', 'on', 'slots' or 'off', got {self.packed_weights!r}")
        if self.packed_weights in ("on", "slots") and torch.device(self.device).type != "cpu":
            raise ConfigError(f"packed_weights {self.packed_weights!r} is for CPU compute; use 'auto' or 'off' on a "
                              "GPU")

    @property
    def packed_slots(self) -> bool:
        """Streamed int8 / int4 weights stay packed in the ring slots (`packed_weights`, runtime/models/packed.py)."""
        from .models.linear import packed_kernel

        if self.packed_weights == "auto":
            return packed_kernel(self.torch_dtype, torch.device(self.device))
        return self.packed_weights in ("on", "slots")

    @property
    def packed_resident(self) -> bool:
        """Resident compressed weights stay packed too (runtime/models/weights.py): "on"; "auto" where packed slots
        are on and a device_memory budget is set (packed, a resident part takes a quarter to a half of the budget,
        but from ~16 rows the kernels multiply slower than a 16-bit GEMM: docs/perf int4_kernel; with all the
        memory there is, the engine keeps its resident weights dequantized)."""
        if self.packed_weights == "auto":
            return self.packed_slots and self.device_memory is not None
        return self.packed_weights == "on"

    def _check_drafter(self) -> None:
        """The drafter is registered and has what its class needs (a checkpoint, a budget)."""
        if self.drafter is not None and not isinstance(self.drafter, str):
            raise ConfigError(f"drafter must be a registered drafter's name or None, got {self.drafter!r}")
        name = self.drafter_name
        cls = drafter_named(name)  # ConfigError naming the registered drafters
        checkpoint = self.draft if self.draft != "self" else None
        if self.draft == "self" and name != "self":
            raise ConfigError(f"draft='self' is the 'self' drafter, but drafter={name!r}: give one of them")
        if cls.needs_checkpoint and checkpoint is None:
            raise ConfigError(f"drafter {name!r} drafts with a model of its own: draft must be its checkpoint "
                              "directory")
        if not cls.needs_checkpoint and checkpoint is not None:
            raise ConfigError(f"drafter {name!r} loads no checkpoint, but draft={str(checkpoint)!r}: drop draft, or "
                              "use the 'model' drafter")
        if cls.offloaded_only and self.device_memory is None:
            raise ConfigError(f"drafter {name!r} ({cls.__name__}) runs in the offloaded pipeline only: it needs "
                              "device_memory (without a budget every weight is resident)")

    @property
    def drafter_name(self) -> str:
        """The drafter's registry name: `drafter`, else from `draft` (None -> "none", "self" -> "self", a
        checkpoint directory -> "model")."""
        if self.drafter is not None:
            return self.drafter
        if self.draft is None:
            return "none"
        return "self" if self.draft == "self" else "model"

    @property
    def drafter_class(self) -> type:
        """The registered class of `drafter_name` (runtime/offload/drafters.py); ask it, not the name."""
        return drafter_named(self.drafter_name)

    @property
    def planned(self) -> bool:
        """True when the planner chooses the batch size or k."""
        return "auto" in (self.num_draft_tokens, self.max_batch_size)

    @property
    def offloaded(self) -> bool:
        """True when the target streams its weights (device_memory is set)."""
        return self.device_memory is not None

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def draft_torch_dtype(self) -> torch.dtype:
        """The draft model's compute dtype: draft_dtype, else the target's."""
        return _DTYPES[self.draft_dtype or self.dtype]

    @property
    def unified_memory(self) -> bool:
        """On the CPU the device *is* host memory: one budget (device_memory) for everything, unless the user
        split it by giving host_memory."""
        return torch.device(self.device).type == "cpu" and self.host_memory is None

    @property
    def host_attention(self) -> bool:
        """Offloaded on a GPU, the target's attention, embedding and KV cache stay in host RAM and the CPU computes
        attention (the paper's design); the GPU runs the FFN / experts, the head and the draft."""
        return self.offloaded and torch.device(self.device).type == "cuda"

    @property
    def host_budget(self) -> int:
        """Bytes of host RAM for the target KV cache and the "ram" weights tier: host_memory, else the machine's."""
        return int(self.host_memory) if self.host_memory is not None else machine_memory_bytes()
