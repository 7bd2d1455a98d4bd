"""The ``corp-deploy`` entry point: interrupts and what reaches the terminal, set up before the
heavy imports (torch, timm, ONNX) so that even an interrupt during them ends cleanly.

Every signal of the platform that ends a process by default and is sent from outside, not raised by
a fault of the process itself such as SIGSEGV (:data:`INTERRUPTS`: SIGINT from Ctrl-C, SIGTERM from
``kill`` or a job scheduler, SIGHUP when the terminal closes or ssh drops, SIGQUIT from Ctrl-\\, the
timers, user and real-time signals other tools send, SIGXCPU at its resource limit, SIGPWR, ...)
raises :class:`Interrupted` in the main thread, so every ``with`` block on the way out removes what
it was writing (:mod:`corp_deploy.outputs`) and every temporary folder; the command then exits with
128 + the signal's number (130, 143, 129, 131, ...) and one line saying which outputs were completed
and which were not written. A signal the process was started ignoring stays ignored (SIGHUP under
``nohup``; SIGINT and SIGQUIT in a script's background job), as do SIGPIPE and SIGXFSZ, which Python
ignores (a write to a closed pipe or beyond the file size limit is an error of the write, handled as
such). Only SIGKILL, which no process can catch, can leave a staging folder behind. Library warnings
and log lines stay off the terminal; corp-deploy's own warnings are printed as ``warning: ...``. A
standard output whose encoding cannot write a character printed (``PYTHONIOENCODING=ascii``) fails
as a write does, with what to change. Libraries that cannot be loaded (torch's under a low ``ulimit -v``)
are one line and exit status 1.

Importing this module (the entry point, and nothing else imports it) installs handlers that keep the
signals received while its own imports load; :func:`main` raises the first once it can end the run
cleanly, so that Ctrl-C just after Enter is one line too, not a traceback.
"""

from __future__ import annotations

import signal

from .interrupts import INTERRUPTS, Interrupted

#: The signals received while this module's own imports load, before :func:`main` installs its
#: handlers (Ctrl-C just after Enter): kept here, and raised by :func:`main` once it can end the run
#: cleanly. (Before this module runs, Python's own start-up is the only time left uncovered.)
_RECEIVED_EARLY: list[int] = []
for _signum in INTERRUPTS:
    if signal.getsignal(_signum) != signal.SIG_IGN:
        signal.signal(_signum, lambda signum, frame: _RECEIVED_EARLY.append(signum))

import codecs
import contextlib
import errno
import io
import logging
import sys
import warnings

from .errors import EXIT_FAILURE, OWN_MODULES, first_line


def main() -> None:
    """Run the command group (:mod:`corp_deploy.cli`) with interrupts and output set up."""
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module=OWN_MODULES)
    warnings.showwarning = _show_warning
    # Drop every log record below ERROR, whatever the levels and handlers a library sets itself (torch
    # gives its loggers a handler of their own on standard error: inductor's import of cpp_extension
    # logs "No CUDA runtime is found, using CUDA_HOME=..." where CUDA_HOME is set and no GPU is seen).
    logging.disable(logging.WARNING)
    if sys.stdout is None:  # started with standard output closed (``>&-``): printing must fail, not vanish
        sys.stdout = _ClosedOutput()
    elif not _writes_every_character(sys.stdout):  # PYTHONIOENCODING=ascii, a C locale
        sys.stdout = _EncodingLimited(sys.stdout)
    if sys.stderr is not None:  # progress and warnings that cannot be written must not stop the work
        sys.stderr = _Diagnostics(sys.stderr)
    for signum in INTERRUPTS:
        if signal.getsignal(signum) != signal.SIG_IGN:  # ignored from the start (nohup's SIGHUP): left so
            signal.signal(signum, _raise_interrupted)
    try:
        if _RECEIVED_EARLY:
            _raise_interrupted(_RECEIVED_EARLY[0], None)
        try:
            from .cli import cli  # after the handlers: an interrupt while torch and timm load ends cleanly
        except ImportError as exc:  # torch's libraries cannot be mapped under a low ``ulimit -v``; a broken install
            with contextlib.suppress(OSError):
                print(
                    f"corp-deploy: its libraries could not be loaded ({type(exc).__name__}: {first_line(exc)}): "
                    "a memory limit too low for them (ulimit -v), or an installation to repair",
                    file=sys.stderr,
                )
            sys.exit(EXIT_FAILURE)
        cli(prog_name="corp-deploy")
    except Interrupted as exc:
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            print(f"\ncorp-deploy: stopped by {exc}; {_what_was_left(exc.completed, exc.abandoned)}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except OSError as exc:  # printing the group's own --help or --version (a command's is handled by the group)
        with contextlib.suppress(OSError):
            print(f"corp-deploy: printing on the standard output failed ({exc.strerror or exc})", file=sys.stderr)
        sys.exit(EXIT_FAILURE)
    finally:
        _ignore_signals()  # the run is over: a late signal no longer changes its outcome


def _what_was_left(done: tuple, abandoned: tuple) -> str:
    """What an interrupted run leaves, in words: the outputs it completed before the interrupt
    (``done``), those it was writing and removed (``abandoned``: ``(path, older output kept)``),
    and that nothing is half-written."""
    said = []
    if done:
        said.append(
            f"{', '.join(map(str, done))} {'was' if len(done) == 1 else 'were'} written before it and "
            f"{'is' if len(done) == 1 else 'are'} complete; the steps after it did not run"
        )
    for path, kept in abandoned:
        said.append(
            f"the new {path} was not written and the one already there is as it was"
            if kept
            else f"{path} was not written (nothing of it is left)"
        )
    if not said:
        said.append("it stopped before writing any output")
    return "; ".join(said) + "; nothing is half-written"


class _ClosedOutput(io.TextIOBase):
    """Standard output for a process started without one (Python leaves ``sys.stdout`` None, and
    ``print`` then writes nowhere): every write fails as a write to a closed descriptor does, so a
    command's results are never lost silently (exit 5 once its output is complete)."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "standard output is closed")


def _writes_every_character(stream) -> bool:
    """Whether ``stream`` encodes text in a Unicode encoding (UTF-8, -16, -32), which can write any."""
    try:
        return codecs.lookup(stream.encoding).name.startswith("utf")
    except (AttributeError, TypeError, LookupError):
        return False


class _EncodingLimited:
    """Standard output in an encoding that cannot write every character (``PYTHONIOENCODING=ascii``,
    a C locale): text it cannot encode fails as an error of the write (OSError, EILSEQ) that says
    what and how to change the encoding, as a closed pipe's does (exit 5 once the output is
    complete), never as a bug. What was printed before is flushed first; nothing of the failed
    write is written (the text is encoded before any of it is)."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except UnicodeEncodeError as exc:
            with contextlib.suppress(OSError):
                self._stream.flush()
            character = exc.object[exc.start]
            raise OSError(
                errno.EILSEQ,
                f"its encoding, {exc.encoding}, cannot write {character!r} (U+{ord(character):04X}); "
                "set PYTHONIOENCODING=utf-8 or use a UTF-8 locale",
            ) from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class _Diagnostics:
    """Standard error that drops what it cannot write (a full disk behind ``2>``), as Python does
    for a standard error that was closed (``2>&-``): progress, warnings and messages are for the
    user to read, and a command's results and exit status do not depend on them."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:
            return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError):
            self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _raise_interrupted(signum, frame) -> None:
    # Every signal raises (none is ignored: a first one swallowed where Python drops exceptions, such
    # as in a finalizer, must not make the run unkillable); the cleanups that must not be cut short
    # hold signals back themselves (corp_deploy.interrupts.signals_deferred).
    raise Interrupted(signum)


def _ignore_signals() -> None:
    for signum in INTERRUPTS:
        signal.signal(signum, signal.SIG_IGN)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=sys.stderr)


if __name__ == "__main__":
    main()
