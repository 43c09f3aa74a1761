"""The worker interface, declared once: `@wire` marks the methods of a worker class that another process may call.

The local backend calls workers directly. The Ray backend (actors/) derives everything from these marks: a role
serves exactly `wire_methods(worker class)`, and its coordinator-side proxy class is generated from the same
table, with the workers' own signatures and docstrings (actors/proxy.py `proxy_class`). Adding a method to a
worker is one decorated method; nothing else is written out again.

    keep_outputs: tensor results stay where they were computed (hidden states, logits): the caller gets a handle
                  and passes it to the next call of the same chain, never copying the tensor (actors/proxy.py).
    returns_tuple: the method returns a tuple of results (read from its return annotation, "tuple[...]").

Arguments and results must be ints, floats, strings, lists of them, tensors, None, or `SamplingParams`, so they
cross the wire (actors/transport/codec.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
_MARK = "__specoffload_wire__"


@dataclass(frozen=True)
class WireMethod:
    """One remotely callable method of a worker class."""

    name: str
    keep_outputs: bool
    returns_tuple: bool
    signature: inspect.Signature
    doc: str | None


def wire(fn: F | None = None, *, keep_outputs: bool = False) -> Any:
    """Mark a worker method as callable over the wire (see the module docstring). `@wire` or `@wire(...)`."""

    def mark(method: F) -> F:
        setattr(method, _MARK, keep_outputs)
        return method

    return mark(fn) if fn is not None else mark


def wire_methods(cls: type) -> Mapping[str, WireMethod]:
    """name -> WireMethod for every `@wire` method of `cls` and its bases, in definition order."""
    methods: dict[str, WireMethod] = {}
    for klass in reversed(cls.__mro__):
        for name, attr in vars(klass).items():
            if callable(attr) and hasattr(attr, _MARK):
                annotation = inspect.signature(attr).return_annotation  # a string under `from __future__ import ...`
                methods[name] = WireMethod(name, getattr(attr, _MARK), str(annotation).startswith("tuple["),
                                           inspect.signature(attr), inspect.getdoc(attr))
    return MappingProxyType(methods)
