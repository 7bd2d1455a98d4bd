"""The interrupts: the signals that end a run cleanly (:data:`INTERRUPTS`), the exception their
handler raises (:class:`Interrupted`, installed by the entry point, :mod:`corp_deploy.launch`), and
holding them back while files are moved or removed (:func:`signals_deferred`)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: The signals that end a run cleanly, each with exit status 128 + its number.
INTERRUPTS = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
    signal.SIGVTALRM,
    signal.SIGPROF,
    signal.SIGXCPU,
    signal.SIGXFSZ,
)


class Interrupted(BaseException):
    """One of :data:`INTERRUPTS` arrived (a BaseException, so no ``except Exception`` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum
        self.completed: tuple = ()  # the outputs the command had put in place (set by the command group)
        self.abandoned: tuple = ()  # (output, older one kept) for those it was writing, removed (likewise)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold the interrupts (:data:`INTERRUPTS`) back while files are moved or
    removed, so that an interrupt never leaves half a swap or half a cleanup: a signal that arrives
    meanwhile is remembered and raised again when the block ends. (Python runs signal handlers in
    the main thread whichever thread received the signal, so the handlers are swapped here rather
    than the threads' signal masks.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {signum: signal.getsignal(signum) for signum in INTERRUPTS}
    for signum in previous:
        signal.signal(signum, lambda number, frame: received.append(number))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if received:
            signal.raise_signal(received[0])
