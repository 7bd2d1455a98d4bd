"""The one exception type that carries a user-facing message."""


class CorpError(Exception):
    """Bad input or an unsupported request, with a message meant for the user.

    The CLI prints the message and exits with ``exit_code`` (1 unless a subclass says
    otherwise) without a traceback; library callers can catch it like any exception.
    """

    exit_code = 1
