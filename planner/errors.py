"""The base of every error whose message is meant for the user.

Everything a user can cause (a bad config, a budget too small, a missing checkpoint, a bad prompt) derives from
`SpecOffloadError`, so a front end catches this one class and prints the message without a traceback.
Programming errors stay built-in exceptions. It lives in the base layer (no torch) because every layer raises it.
"""


class SpecOffloadError(Exception):
    """Base class of errors whose message is meant for the user."""
