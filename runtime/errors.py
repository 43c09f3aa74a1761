"""`ConfigError`: an invalid engine configuration. Its own module so that what the config validates against (the
drafter registry, runtime/offload/drafters.py) can raise it without importing the config."""

from __future__ import annotations

from specoffload.planner.errors import SpecOffloadError


class ConfigError(SpecOffloadError, ValueError):
    """An invalid EngineConfig field."""
