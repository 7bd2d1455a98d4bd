"""The one exception type that carries a user-facing message."""


class CorpError(Exception):
    """Bad input or an unsupported request, with a message meant for the user.

    The CLI prints the message and exits non-zero without a traceback; library
    callers can catch it like any exception.
    """
