"""User-facing error types of the model runtime.

Everything a user can cause by pointing us at a bad checkpoint derives from `SpecOffloadError`, so a CLI can
catch that one class and print the message without a traceback. Programming errors stay built-in exceptions.
"""


class SpecOffloadError(Exception):
    """Base class of errors whose message is meant for the user."""


class CheckpointError(SpecOffloadError):
    """The checkpoint directory or one of its files is missing, unreadable or inconsistent."""


class UnsupportedModelError(SpecOffloadError):
    """The checkpoint is valid but its architecture (or one of its options) is not implemented here."""
