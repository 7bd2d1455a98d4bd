"""The interrupts: the signals that end a run cleanly (:data:`INTERRUPTS`), the exception their
handler raises (:class:`Interrupted`, installed by the entry point, :mod:`corp_deploy.launch`), and
holding them back while files are moved or removed (:func:`signals_deferred`)."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: Signals whose default action does not end a process: it ignores them (SIGCHLD, SIGURG,
#: SIGWINCH, BSD's SIGINFO, and SIGIO outside Linux), continues (SIGCONT) or stops (SIGTSTP, SIGTTIN,
#: SIGTTOU, SIGSTOP).
_NOT_ENDING = {
    "SIGCHLD",
    "SIGCLD",
    "SIGURG",
    "SIGWINCH",
    "SIGINFO",
    "SIGCONT",
    "SIGTSTP",
    "SIGTTIN",
    "SIGTTOU",
    "SIGSTOP",
}
_NOT_ENDING |= set() if sys.platform.startswith("linux") else {"SIGIO", "SIGPOLL"}
#: Signals that end a process but are not interrupts: SIGKILL, which no process can catch; the faults
#: a process raises on itself (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP, SIGSYS, SIGEMT:
#: Python code cannot go on after them, and a handler would hide the crash); and SIGPIPE and SIGXFSZ,
#: which Python ignores, so that a write to a closed pipe or beyond the file size limit fails as an
#: error of the write, handled as such.
_NOT_INTERRUPTS = {
    "SIGKILL",
    "SIGSEGV",
    "SIGBUS",
    "SIGFPE",
    "SIGILL",
    "SIGABRT",
    "SIGIOT",
    "SIGTRAP",
    "SIGSYS",
    "SIGEMT",
    "SIGPIPE",
    "SIGXFSZ",
}


def signal_name(signum: int) -> str:
    """``SIGTERM``; a real-time signal as ``SIGRTMIN+N``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIGRTMIN+{signum - signal.SIGRTMIN}" if hasattr(signal, "SIGRTMIN") else f"signal {signum}"


#: The signals that end a run cleanly, each with exit status 128 + its number: every signal of this
#: platform whose default action ends the process (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1/2, the
#: timers, SIGXCPU, SIGPWR, SIGIO and SIGSTKFLT on Linux, every real-time signal, ...), but those of
#: :data:`_NOT_INTERRUPTS`. (Which signals those are is fixed by the platform; the default actions
#: are POSIX's, and Linux's signal(7) for the signals it adds.)
INTERRUPTS = tuple(
    signum for signum in sorted(signal.valid_signals()) if signal_name(signum) not in _NOT_ENDING | _NOT_INTERRUPTS
)


class Interrupted(BaseException):
    """One of :data:`INTERRUPTS` arrived (a BaseException, so no ``except Exception`` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
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
