"""The one error type of the MoE builders: a message for the user, printed as one line."""


class MoEBuildError(RuntimeError):
    """Bad input (a missing directory, an impossible size) or a source the builders cannot convert."""
