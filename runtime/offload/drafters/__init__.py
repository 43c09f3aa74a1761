"""Drafters: who proposes the draft tokens the target verifies. A drafter is one module of this package.

    Drafter        the interface (a Protocol): per-batch state managed by the coordinator, `propose`, and `adapt`
                   (what the target routed since the last call; a no-op but for the next one)
    DrafterTraits  what the rest of the engine must know of a drafter class, declared on the class: a checkpoint?
                   an MoE target? its footprint for placement, its step for the profiler, its `options`
    NoDrafter      no speculation (k = 0): holds nothing, is never asked to propose ("none")

The modules beside this one are the drafters, each registering itself with `register_drafter(name, cls)`:
model.py ("model": an external draft model), resident_experts.py ("self": the MoE target with only its resident
experts), lowbit.py ("lowbit": the target with low-bit copies of the parts it streams), modelfree.py ("ngram",
"suffix": prompt lookup and suffix matching); shared_kv.py registers none: it is the KV handling of the drafters
built from the target itself (drafting into the target's cache). Every module of this package is
imported when the package is, so a new drafter is one new file here (or, outside the package, one
`register_drafter` call before the config names it). Config, CLI, planning, profiler and engine ask the class,
never the name.

A drafter's settings are its `options`: a frozen dataclass whose fields (`option`, with their help) are
`EngineConfig.drafter_options` keys and `specoffload` flags (`--prompt-lookup-max` for `prompt_lookup_max`);
`settings(config)` builds them, checked, from the config.

`drafter_class(config)` is the class the config names (every drafter is built as cls(config, weights, slots),
like the workers, so a draft role can build it in its own process); `make_drafter(config, plan, weights)` builds
it, or NoDrafter when the plan does not speculate. A drafter proposes one token per call, for every row of
one batch: the schedule interleaves the k calls of a round with the target's layers (schedule.py); a negative
token means the row proposes nothing more this round (runtime/speculative.py `cut_drafts`: its draft stops there,
and a round stops early once no row has a draft left). Its KV cache holds a prefix of each row's committed
tokens; the coordinator feeds it the rest at the round's first call and truncates it to what the target accepted
after verification.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

from specoffload.planner.plan import Plan
from specoffload.planner.shapes import ModelShape, PartKey

from ...errors import ConfigError
from ...kv_cache import KVCache
from ...models.model import Transformer
from ...sampling import SamplingParams

if TYPE_CHECKING:
    from ...config import EngineConfig
    from ..workers import WeightPlan

Tensor = torch.Tensor


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for the rows of one batch b in {0, 1}; see the module docstring."""

    def reset(self, batch: int, rows: int, capacity: int) -> None: ...
    def drop(self, batch: int) -> None: ...
    def lengths(self, batch: int) -> list[int]: ...
    def truncate(self, batch: int, lengths: Sequence[int]) -> None:
        """Keep at most lengths[r] positions of row r."""
        ...
    def select_rows(self, batch: int, keep: Sequence[int]) -> None: ...
    def reset_rows(self, batch: int, rows: Sequence[int], capacity: int) -> None:
        """Empty these rows for new requests (refill: the other rows keep their state)."""
        ...
    def add_rows(self, batch: int, n: int, capacity: int) -> None:
        """Append n empty rows for new requests (a batch that lost rows to preemption regrows)."""
        ...

    def propose(self, batch: int, ids: Tensor, num_new: Tensor, params: SamplingParams,
                seeds: Sequence[int] | None = None,
                warps: Sequence[Sequence[float]] | None = None) -> tuple[Tensor, Tensor | None]:
        """Feed ids [rows, T] (row r: its first num_new[r] valid) and draw the next token per row: (token [rows],
        probs [rows, vocab] of the warped draft distribution, or None when greedy). seeds: one per row, the
        row's own draw (runtime/rng.py); None: torch's global generator. warps: each row's own (temperature,
        top_p, top_k) instead of params' (runtime/sampling.py `warp_rows`). A token < 0: the row proposes nothing
        more this round. probs None with sampled rows: the drafts are deterministic (a point mass on each token).
        `lengths` is called at the start of every round, before its first `propose`."""
        ...

    def adapt(self, routing_counts: list[list[int]]) -> list[int]:
        """The target's routing since the last call (per layer, tokens per expert; [] for a dense layer): the
        drafter may re-choose what it keeps. Returns [hits, picks, bytes moved, experts moved]."""
        ...


@dataclass(frozen=True)
class DraftFootprint:
    """What planning and placement count of a drafter (runtime/planning.py `ModelPair`)."""

    shape: ModelShape | None  # its parts and KV bytes per token, as placement counts them; None: it never drafts
    top_k: int = 0  # routed experts per token of an MoE drafter (0: dense)
    dtype_bytes: int = 0  # bytes per element of its compute dtype (0: the target's)
    experts: int = 0  # a resident-expert drafter's routed experts per layer (the plan's draft_experts; 0: another)
    pins: frozenset[PartKey] = field(default=frozenset())  # target parts it shares: resident whenever it drafts


def option(default: Any, help: str) -> Any:
    """A field of a drafter's options dataclass: its default and the help its command-line flag shows."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class NoOptions:
    """The options of a drafter that has none."""


class DrafterTraits:
    """What the engine must know of a drafter class before it builds one, declared on the class (the defaults: a
    drafter that proposes, runs offloaded, and holds nothing placement must count). A drafter subclasses it (or
    declares every attribute and class method itself); config, planning, profiler and engine ask these, never the
    drafter's name.

    proposes          False only for NoDrafter: nothing to speculate with (the plan's k is 0)
    needs_checkpoint  config.draft is the checkpoint directory of its model (on the target's vocabulary)
    needs_moe_target  it drafts with the target's routed experts: a dense target is a ConfigError
    offloaded_only    it runs with device_memory set only; False: a resident engine (the same pipeline, nothing
                      streamed) runs it too
    shares_target     in the target's process it drafts with the target's own parts and KV cache (`TargetShare`)
    model_free        it holds no model and proposes in microseconds (modelfree.py): a backend builds it in the
                      coordinator's process (no draft actor), and one batch drafts between its passes by default
    options           a frozen dataclass of its settings (fields made with `option`; validated in its
                      __post_init__, raising ConfigError): EngineConfig.drafter_options keys and CLI flags
    settings          (class method) its options as the config sets them
    adapt_interval    (class method) verify rounds between two `adapt` calls, where its `adapt` re-chooses what it
                      keeps (0: never)
    footprint         (class method) its weights and KV cache as placement counts them
    profile_key       (class method) what the profiled draft step depends on (profiler.py `fingerprint`)
    step_model        (class method) the model one draft step runs, for the profiler to time
    """

    proposes: ClassVar[bool] = True
    needs_checkpoint: ClassVar[bool] = False
    needs_moe_target: ClassVar[bool] = False
    offloaded_only: ClassVar[bool] = True
    shares_target: ClassVar[bool] = False
    model_free: ClassVar[bool] = False
    options: ClassVar[type] = NoOptions

    @classmethod
    def settings(cls, config: EngineConfig) -> Any:
        """Its `options`, from config.drafter_options (the keys it names; the rest keep their defaults)."""
        return build_options(cls, config.drafter_options)

    @classmethod
    def adapt_interval(cls, config: EngineConfig) -> int:
        """Verify rounds between two `adapt` calls the pipeline makes (0: never; default, it keeps nothing)."""
        return 0

    @classmethod
    def footprint(cls, config: EngineConfig, target: Transformer, shares_kv: bool) -> DraftFootprint:
        """Its parts and KV cache as placement counts them. target: the target's executor (headers only, nothing
        loaded); shares_kv: it is built in the target's process (`TargetShare`). Default: no weights, no cache."""
        return DraftFootprint(ModelShape(cls.__name__, (), 0, 0))

    @classmethod
    def profile_key(cls, config: EngineConfig) -> str:
        """What the profiled draft step depends on (a new value re-measures the profile); default: its name."""
        return config.drafter_name

    @classmethod
    def step_model(cls, config: EngineConfig) -> tuple[Transformer, dict[int, Tensor] | None] | None:
        """(model, allowed experts per layer or None) one draft step runs, loaded, for the profiler to time; None:
        nothing to time (the profile assumes a nominal step)."""
        return None


class NoDrafter(DrafterTraits):
    """k = 0: no draft model, one batch, nothing to propose."""

    proposes = False
    offloaded_only = False

    @classmethod
    def footprint(cls, config: EngineConfig, target: Transformer, shares_kv: bool) -> DraftFootprint:
        return DraftFootprint(None)

    @classmethod
    def profile_key(cls, config: EngineConfig) -> str:
        return ""

    def reset(self, batch: int, rows: int, capacity: int) -> None:
        pass

    def drop(self, batch: int) -> None:
        pass

    def lengths(self, batch: int) -> list[int]:
        return []

    def truncate(self, batch: int, lengths: Sequence[int]) -> None:
        pass

    def select_rows(self, batch: int, keep: Sequence[int]) -> None:
        pass

    def reset_rows(self, batch: int, rows: Sequence[int], capacity: int) -> None:
        pass

    def add_rows(self, batch: int, n: int, capacity: int) -> None:
        pass

    def propose(self, batch: int, ids: Tensor, num_new: Tensor, params: SamplingParams,
                seeds: Sequence[int] | None = None,
                warps: Sequence[Sequence[float]] | None = None) -> tuple[Tensor, Tensor | None]:
        raise RuntimeError("NoDrafter was asked to propose: the plan has k = 0 (schedule bug)")

    def adapt(self, routing_counts: list[list[int]]) -> list[int]:
        return [0, 0, 0, 0]


#: the Drafter methods every registered class implements (the coordinator calls them, locally or over the wire)
DRAFTER_METHODS = ("reset", "drop", "lengths", "truncate", "select_rows", "reset_rows", "propose", "adapt")
#: the class attributes every registered class declares (`DrafterTraits`)
DRAFTER_TRAITS = ("proposes", "needs_checkpoint", "needs_moe_target", "offloaded_only", "shares_target",
                  "model_free", "options", "settings", "adapt_interval", "footprint", "profile_key", "step_model")

#: drafter name (EngineConfig.drafter) -> class; add one with `register_drafter`
DRAFTERS: dict[str, type] = {}


def register_drafter(name: str, cls: type) -> type:
    """Make `cls` the drafter EngineConfig(drafter=name) runs; returns cls. It implements `Drafter` and declares
    `DrafterTraits` (subclass it for the defaults). A name already taken by another class is an error."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a drafter's name is a non-empty string, got {name!r}")
    missing = [m for m in DRAFTER_METHODS if not callable(getattr(cls, m, None))]
    missing += [t for t in DRAFTER_TRAITS if not hasattr(cls, t)]
    if missing:
        raise TypeError(f"drafter class {cls.__name__} lacks {', '.join(missing)}: it implements Drafter and "
                        f"subclasses DrafterTraits (runtime/offload/drafters/)")
    if DRAFTERS.get(name, cls) is not cls:
        raise ValueError(f"drafter name {name!r} is taken by {DRAFTERS[name].__name__}")
    if not dataclasses.is_dataclass(cls.options):
        raise TypeError(f"drafter class {cls.__name__}: options must be a dataclass, got {cls.options!r}")
    owners = option_owners()
    for f in dataclasses.fields(cls.options):
        other = owners.get(f.name)
        if other is not None and other.options is not cls.options:
            raise ValueError(f"drafter option {f.name!r} of {cls.__name__} is taken by {other.__name__}'s options")
    DRAFTERS[name] = cls
    return cls


def option_owners() -> dict[str, type]:
    """Every registered drafter option name -> the (first) drafter class whose options have it."""
    owners: dict[str, type] = {}
    for cls in DRAFTERS.values():
        for f in dataclasses.fields(cls.options):
            owners.setdefault(f.name, cls)
    return owners


def build_options(cls: type, values: Mapping[str, Any]) -> Any:
    """cls.options from the keys of `values` its fields name (ConfigError for a bad value)."""
    names = {f.name for f in dataclasses.fields(cls.options)}
    try:
        return cls.options(**{k: v for k, v in values.items() if k in names})
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def check_options(values: Mapping[str, Any]) -> None:
    """Every key of `values` is some registered drafter's option and every drafter accepts its values
    (ConfigError naming the unknown key and the known ones, or the drafter's own message)."""
    owners = option_owners()
    unknown = sorted(k for k in values if k not in owners)
    if unknown:
        known = ", ".join(sorted(owners)) or "none"
        raise ConfigError(f"unknown drafter option {unknown[0]!r}: the registered drafters' options are {known}")
    for cls in {owners[k] for k in values}:
        build_options(cls, values)


def drafter_named(name: str) -> type:
    """The registered drafter class `name`; ConfigError naming the registered drafters when there is none."""
    cls = DRAFTERS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"unknown drafter {name!r}: registered drafters are {', '.join(sorted(DRAFTERS))} "
                          f"(add one with register_drafter, runtime/offload/drafters/)")
    return cls


def drafter_class(config: EngineConfig) -> type:
    """The drafter class the config names (`EngineConfig.drafter_name`)."""
    return drafter_named(config.drafter_name)


@dataclass(frozen=True)
class TargetShare:
    """What the target's workers in this process lend a drafter built from the target itself: the per-batch KV
    caches (the attention worker's), the resident parts (attention's and verifier's), and the embedding."""

    kv: dict[int, KVCache]
    parts: Mapping[PartKey, object]
    embed: Callable[[Tensor], Tensor]


def make_drafter(config: EngineConfig, plan: Plan, weights: WeightPlan, share: TargetShare | None = None) -> Drafter:
    """The drafter the config asks for, or NoDrafter when the plan does not speculate. share: the target's state
    in this process, for a drafter that drafts with it (`shares_target`)."""
    if not plan.drafting:
        return NoDrafter()
    cls = drafter_class(config)
    if cls.shares_target and share is not None:
        return cls(config, weights, share=share)
    return cls(config, weights)


register_drafter("none", NoDrafter)
for _module in pkgutil.iter_modules(__path__):  # every drafter module of this package registers itself
    importlib.import_module(f"{__name__}.{_module.name}")
