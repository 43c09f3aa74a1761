"""Typed wire messages and their one codec (msgpack, never pickle), plus tensors passed by reference.

Every message type is a frozen dataclass registered with `@message` in this module. On the wire a message is a
msgpack extension (type 1) whose payload is the array `[tag, field_1, ..., field_n]` in dataclass field order,
the tag being the class name; messages nest (the `TensorRef`s inside an `OpRequest`). Field values are checked
against the type hints on both sides, so a message the peer cannot decode fails at `encode` already.

Decoding is strict: anything but one registered message (unknown tags or extension types, wrong field counts or
types, trailing bytes, a pickle) raises `WireError`. Decoding is also bounded, since the bytes come from a socket:
a message over `MAX_MESSAGE_BYTES` is refused before it is unpacked, messages nest at most `MAX_NESTING` deep (each
level is another msgpack unpack on the C stack: a few hundred levels fit in under 1 KB and would overflow it) and
plain lists in `MetaValue`s at most `MAX_LIST_DEPTH` deep. Allowed field types: int, float, str, bool, bytes, None,
tuple[X, ...], list[X], dict[str, X], unions of them, other messages, and `MetaValue` (scalars and lists).

Tensors never go on the wire: `write_tensor` copies one into a shared-memory arena and returns its `TensorRef`
header (or `tensor_view` hands the producer the arena memory to compute into), and `read_tensor` turns a header
back into a zero-copy view.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

import msgpack
import torch

from specoffload.planner.errors import SpecOffloadError
from specoffload.runtime.sampling import SamplingParams

from .arena import Arena, Region

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_EXT_MESSAGE = 1
#: the largest encoded message a peer may send (ZeroMQ sockets refuse larger frames too, see channel.py)
MAX_MESSAGE_BYTES = 64 << 20
#: how deep messages may nest in messages (WorkerCall -> TensorRef is 2)
MAX_NESTING = 8
#: how deep plain lists may nest in a MetaValue
MAX_LIST_DEPTH = 16

MetaValue = int | float | str | bool | list | None  # `list`: nested lists of these scalars


class WireError(SpecOffloadError, ValueError):
    """Bytes that are not a valid message, or a message / tensor header that cannot be put on the wire."""


Checker = Callable[[Any], Any]  # validates one value of a type hint, returns it (arrays rebuilt as tuples/lists)
_REGISTRY: dict[str, type] = {}
_FIELDS: dict[type, tuple[tuple[str, Checker], ...]] = {}  # see _fields
M = TypeVar("M")


def message(cls: type[M]) -> type[M]:
    """Register a frozen dataclass as a wire message; its class name is its tag."""
    if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"@message needs a frozen dataclass, got {cls!r}")
    if cls.__name__ in _REGISTRY:
        raise TypeError(f"message tag {cls.__name__!r} is already registered")
    _REGISTRY[cls.__name__] = cls
    try:
        _fields(cls)  # an unsupported field type fails here, not on first use
    except NameError:  # a forward reference to a later class: checked on first use instead
        _FIELDS.pop(cls, None)
    except TypeError:
        del _REGISTRY[cls.__name__]
        raise
    return cls


def encode(msg: Any) -> bytes:
    """The wire bytes of a registered message."""
    if not _is_message(msg):
        raise WireError(f"{type(msg).__name__} is not a registered message")
    try:
        return msgpack.packb(msg, default=_pack_message, use_bin_type=True)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"cannot encode {type(msg).__name__}: {e}") from None


def decode(data: bytes) -> Any:
    """The message in `data`; raises WireError for anything else."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        msg = _unpack(data, 0)
    except WireError:
        raise
    except Exception as e:  # msgpack raises a zoo of types on garbage (ExtraData, FormatError, StackError, ...)
        raise WireError(f"malformed message ({type(e).__name__}: {e})") from None
    if not _is_message(msg):
        raise WireError(f"expected a message, got {type(msg).__name__}")
    return msg


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise WireError(f"dtype {dtype} cannot be sent (allowed: {', '.join(DTYPES)})") from None


@message
@dataclass(frozen=True)
class TensorRef:
    """Header of a tensor in a shared-memory arena: arena name (`Arena.name`), byte offset, dtype, shape."""

    arena: str
    offset: int
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if type(self.shape) is not tuple:
            object.__setattr__(self, "shape", tuple(self.shape))
        if self.dtype not in DTYPES:
            raise WireError(f"dtype {self.dtype!r} is not allowed on the wire (allowed: {', '.join(DTYPES)})")
        if self.offset < 0 or min(self.shape, default=0) < 0:
            raise WireError(f"negative offset or dimension in {self}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


@message
@dataclass(frozen=True)
class OpRequest:
    """One operation for a worker process.

    Index convention (FlexGen's): the i-th `token` position, j-th `layer`, k-th micro-`batch`, at decode `step`;
    `slot` is the ring-buffer slot holding the operands. Fields that do not apply to a `kind` stay 0.
    tensors: operands by name, in arenas the worker has attached. meta: small scalars and lists.
    """

    op_id: int
    kind: str
    step: int = 0
    layer: int = 0
    batch: int = 0
    token: int = 0
    slot: int = 0
    tensors: dict[str, TensorRef] = field(default_factory=dict)
    meta: dict[str, MetaValue] = field(default_factory=dict)


@message
@dataclass(frozen=True)
class OpResult:
    """The outcome of `OpRequest` `op_id`: outputs by reference, or ok=False and an error message."""

    op_id: int
    ok: bool = True
    tensors: dict[str, TensorRef] = field(default_factory=dict)
    meta: dict[str, MetaValue] = field(default_factory=dict)
    error: str | None = None


@message
@dataclass(frozen=True)
class ErrorReply:
    """A server's answer to a request it could not decode or whose handler raised (see `channel.Server`)."""

    error: str


def write_tensor(arena: Arena, region: Region, tensor: torch.Tensor) -> TensorRef:
    """Copy `tensor` into `region` of `arena` and return its header."""
    ref, view = tensor_view(arena, region, tensor.dtype, tuple(tensor.shape))
    view.copy_(tensor)
    return ref


def tensor_view(
    arena: Arena, region: Region, dtype: torch.dtype, shape: tuple[int, ...]
) -> tuple[TensorRef, torch.Tensor]:
    """The header and a writable view of a tensor placed at `region`: compute straight into it (zero copy)."""
    ref = TensorRef(arena.name, region.offset, dtype_name(dtype), shape)
    if ref.nbytes > region.nbytes:
        raise ValueError(f"a {dtype} tensor of shape {tuple(shape)} ({ref.nbytes} bytes) does not fit {region}")
    return ref, arena.view(region.offset, dtype, ref.shape)


def read_tensor(arenas: Mapping[str, Arena], ref: TensorRef) -> torch.Tensor:
    """A zero-copy view of the tensor `ref` describes; `.clone()` it to keep it past the region's reuse."""
    arena = arenas.get(ref.arena)
    if arena is None:
        raise WireError(f"tensor in unknown arena {ref.arena!r} (attached: {', '.join(arenas) or 'none'})")
    try:
        return arena.view(ref.offset, ref.torch_dtype, ref.shape)
    except ValueError as e:
        raise WireError(f"bad tensor header {ref}: {e}") from None


def _fields(cls: type) -> tuple[tuple[str, Checker], ...]:
    """(field name, checker of its type hint) of a message class, in field order."""
    fields = _FIELDS.get(cls)
    if fields is None:
        hints = typing.get_type_hints(cls)
        fields = _FIELDS[cls] = tuple((f.name, _checker(hints[f.name])) for f in dataclasses.fields(cls))
    return fields


def _is_message(obj: Any) -> bool:
    return _REGISTRY.get(type(obj).__name__) is type(obj)


def _pack_message(obj: Any) -> msgpack.ExtType:
    cls = type(obj)
    if not _is_message(obj):
        raise WireError(f"{cls.__name__} is not a registered message (torch tensors go through arenas)")
    values: list[Any] = [cls.__name__]
    name = ""
    try:
        for name, check in _fields(cls):
            values.append(check(getattr(obj, name)))
    except WireError as e:
        raise WireError(f"{cls.__name__}.{name}{e}") from None
    return msgpack.ExtType(_EXT_MESSAGE, msgpack.packb(values, default=_pack_message))


def _unpack(data: bytes, depth: int) -> Any:
    """Unpack `data`, found `depth` messages deep; a message inside is unpacked one level deeper."""

    def ext_hook(code: int, payload: bytes) -> Any:
        return _unpack_message(code, payload, depth + 1)

    return msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=True, use_list=True)


def _unpack_message(code: int, payload: bytes, depth: int) -> Any:
    if code != _EXT_MESSAGE:
        raise WireError(f"unknown msgpack extension type {code}")
    if depth > MAX_NESTING:
        raise WireError(f"messages nested more than {MAX_NESTING} deep")
    items = _unpack(payload, depth)
    if type(items) is not list or not items or type(items[0]) is not str:
        raise WireError("a message payload must be [tag, fields...]")
    tag = items[0]
    cls = _REGISTRY.get(tag)
    if cls is None:
        raise WireError(f"unknown message tag {tag!r}")
    fields = _fields(cls)
    if len(items) != len(fields) + 1:
        raise WireError(f"{tag} has {len(fields)} fields, got {len(items) - 1}")
    kwargs = {}
    name = ""
    try:
        for (name, check), value in zip(fields, items[1:]):
            kwargs[name] = check(value)
    except WireError as e:
        raise WireError(f"{tag}.{name}{e}") from None
    try:
        return cls(**kwargs)
    except WireError:
        raise
    except (TypeError, ValueError) as e:
        raise WireError(f"invalid {tag}: {e}") from None


_SCALARS = (int, float, str, bool, bytes, type(None))


@functools.cache
def _checker(hint: Any) -> Checker:
    """A function that validates (and rebuilds) values of type `hint`; its WireError text starts with a location
    suffix ("[3]: ...", ": ...") so `_check` can prefix the field name."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    arms = args if origin is Union or origin is types.UnionType else (hint,)
    if all(arm in _SCALARS or arm is list for arm in arms):  # scalars (and MetaValue's plain lists): type test
        allowed = frozenset(arms) | ({int} if float in arms else set())
        to_float = float in arms and int not in arms
        plain_lists = list in arms

        def check_scalar(v: Any) -> Any:
            t = type(v)
            if t in allowed and (t is not list or _is_plain(v)):
                return float(v) if to_float and t is int else v
            if plain_lists and t is tuple and _is_plain(v):
                return list(v)
            raise WireError(f": expected {getattr(hint, '__name__', hint)}, got {t.__name__} {v!r:.60}")

        return check_scalar
    if origin is Union or origin is types.UnionType:
        checkers = [_checker(arm) for arm in arms]

        def check_union(v: Any) -> Any:
            for check in checkers:
                try:
                    return check(v)
                except WireError:
                    pass
            raise WireError(f": {type(v).__name__} matches none of {hint}")

        return check_union
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        item, build = _checker(args[0]), (list if origin is list else tuple)

        def check_array(v: Any) -> Any:
            if type(v) not in (list, tuple):
                raise WireError(f": expected an array, got {type(v).__name__}")
            out = []
            for i, x in enumerate(v):
                try:
                    out.append(item(x))
                except WireError as e:
                    raise WireError(f"[{i}]{e}") from None
            return build(out)

        return check_array
    if origin is tuple and args:
        items = [_checker(a) for a in args]

        def check_tuple(v: Any) -> Any:
            if type(v) not in (list, tuple) or len(v) != len(items):
                raise WireError(f": expected an array of {len(items)} items, got {type(v).__name__} {v!r:.60}")
            out = []
            for i, (check, x) in enumerate(zip(items, v)):
                try:
                    out.append(check(x))
                except WireError as e:
                    raise WireError(f"[{i}]{e}") from None
            return tuple(out)

        return check_tuple
    if origin is dict and args and args[0] is str:
        value_check = _checker(args[1])

        def check_map(v: Any) -> Any:
            if type(v) is not dict:
                raise WireError(f": expected a map, got {type(v).__name__}")
            out = {}
            for k, x in v.items():
                if type(k) is not str:
                    raise WireError(f": map key {k!r} is not a str")
                try:
                    out[k] = value_check(x)
                except WireError as e:
                    raise WireError(f"[{k!r}]{e}") from None
            return out

        return check_map
    if isinstance(hint, type) and _REGISTRY.get(hint.__name__) is hint:

        def check_message(v: Any) -> Any:
            if type(v) is not hint:  # decoded nested messages are already objects (see _unpack_message)
                raise WireError(f": expected {hint.__name__}, got {type(v).__name__}")
            return v

        return check_message
    raise TypeError(f"type hint {hint!r} is not supported on the wire")


def _is_plain(value: Any, depth: int = 0) -> bool:
    if type(value) in (int, float, str, bool, type(None)):
        return True
    return type(value) in (list, tuple) and depth < MAX_LIST_DEPTH and all(_is_plain(v, depth + 1) for v in value)


# ---- actor runtime (actors/roles.py, actors/proxy.py): a plain worker method called across processes -------------

message(SamplingParams)  # decoding settings cross the wire as they are (a frozen dataclass of scalars)


@message
@dataclass(frozen=True)
class WorkerCall:
    """A call of the plain worker method `method` (runtime/offload/workers.py) on an actor role, by keyword.

    tensors: tensor arguments by reference; scalars: int and int-list arguments; params: the SamplingParams
    argument of the methods that take one. lane: which of the role's output regions receives the result tensors:
    a lane >= 0 carries one batch's chain of hidden states (embed -> attention -> ffn -> ... -> head -> verify),
    a lane < 0 belongs to one calling thread (results the caller copies out at once).
    """

    method: str
    tensors: dict[str, TensorRef] = field(default_factory=dict)
    scalars: dict[str, MetaValue] = field(default_factory=dict)
    params: SamplingParams | None = None
    lane: int = 0


@message
@dataclass(frozen=True)
class WorkerReply:
    """The return value of a WorkerCall, one entry per output (a method returning a tuple has several): output i is
    tensors[i] when that is not None (in the role's output arena), else values[i]. bytes_read: bytes the call read
    from the weights tier (the coordinator sums them)."""

    tensors: tuple[TensorRef | None, ...] = ()
    values: tuple[MetaValue, ...] = ()
    bytes_read: int = 0
