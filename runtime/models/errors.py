"""User-facing error types of the model runtime (the base `SpecOffloadError` is in planner/errors.py)."""

from specoffload.planner.errors import SpecOffloadError


class CheckpointError(SpecOffloadError):
    """The checkpoint directory or one of its files is missing, unreadable or inconsistent."""


class UnsupportedModelError(SpecOffloadError):
    """The checkpoint is valid but its architecture (or one of its options) is not implemented here."""
