"""The one way the actors layer waits on Ray: an error raised inside an actor comes back as its own type."""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import RayTaskError


def ray_get(ref: Any, timeout_s: float | None = None) -> Any:
    """ray.get, re-raising an actor's error as its own type (e.g. PromptError), not RayTaskError. Ray's own errors
    (timeouts, dead actors) pass through for the caller to name."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except RayTaskError as exc:
        raise exc.as_instanceof_cause() from None


def first_line(exc: BaseException, with_type: bool = False) -> str:
    """The first line of an error's message (at most 300 characters), for one-line logs and errors."""
    text = str(exc).strip()
    line = text.splitlines()[0][:300] if text else ""
    if not line:
        return type(exc).__name__
    return f"{type(exc).__name__}: {line}" if with_type else line
