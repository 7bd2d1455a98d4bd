"""The ``corp-deploy`` command group: exit statuses, and every failure as one message.

Every failure reaches the user as one message and an exit status (:data:`EXIT_CODES`), never a
traceback: bad input and refusals are :class:`CorpError`, running out of memory is handled here,
and interrupts (SIGINT, SIGTERM and every other signal that ends a process) by the entry point,
:mod:`corp_deploy.launch`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import tempfile
from pathlib import Path

import click

from .. import __version__
from ..errors import (
    EXIT_BAD_USAGE,
    EXIT_FAILURE,
    EXIT_GATE_FAILED,
    EXIT_INCOMPLETE,
    EXIT_OUTPUT_COMPLETE,
    OWN_MODULES,
    CorpError,
    SettingError,
    first_line,
)
from ..interrupts import Interrupted
from ..outputs import NotedOutputs, noting_outputs
from ..resources import size_in_words

#: Exit statuses of every command (README, "Guarantees"): by status, and ``128+N`` for the other signals.
EXIT_CODES = {
    0: "done",
    EXIT_FAILURE: "error: what a value names cannot be used (a missing file, a model timm cannot build, weights that "
    "do not fit), a refusal, or a failure; nothing half-written",
    EXIT_BAD_USAGE: "bad usage: a value refused as such (its range, type, choices or form, or it does nothing) or "
    "options that exclude each other",
    EXIT_INCOMPLETE: "export: files written, a step needs TensorRT or a GPU to finish",
    EXIT_GATE_FAILED: "a gate failed (export: nothing written; bench: reports written)",
    EXIT_OUTPUT_COMPLETE: "the output is complete, but a step after it failed (e.g. printing the results): the message "
    "names both",
    129: "stopped by SIGHUP (terminal closed, ssh dropped)",
    130: "interrupted by SIGINT",
    131: "stopped by SIGQUIT",
    143: "terminated by SIGTERM",
    "128+N": "stopped by another signal N that ends a process (SIGUSR1: 138); after any signal the message "
    "names the outputs completed and those not written: nothing is half-written",
}
#: Settings (fields of the config classes) whose option is not ``--<field with dashes>``.
_SETTING_OPTIONS = {
    "compensation": "--no-compensation",
    "sparsity": "--s",
    "samples": "--calib-samples",
    "source": "--calib",
    "workspace_gb": "--workspace",
    "budgets": "--macs",
    "gates": "--gate",
}


#: Where the group keeps the running command's arguments as typed (``ctx.meta``).
COMMAND_LINE = "corp_deploy.command_line"


#: Settings whose option differs in one command (sweep runs several methods).
_COMMAND_SETTING_OPTIONS = {"sweep": {"method": "--methods"}}


def option_name(setting: str, command: str | None = None) -> str:
    """The command-line option of a setting (in ``command``): ``s_mlp`` -> ``--s-mlp``."""
    own = _COMMAND_SETTING_OPTIONS.get(command, {})
    return own.get(setting) or _SETTING_OPTIONS.get(setting, "--" + setting.replace("_", "-"))


class _Command(click.Command):
    """A command that refuses an option of one value given more than once (click would keep the
    last one silently: ``--s 0.5 --s 0.7`` would compress at 0.7 with no word said)."""

    def parse_args(self, ctx, args):
        _refuse_repeated_options(self, args)
        return super().parse_args(ctx, args)


def _refuse_repeated_options(command: click.Command, args: list[str]) -> None:
    """UsageError (exit 2) naming the first option of one value that ``args`` gives twice; the
    names of a flag pair (``--x/--no-x``) count as one option."""
    options = {
        name: param
        for param in command.params
        if isinstance(param, click.Option) and not (param.multiple or param.count)
        for name in (*param.opts, *param.secondary_opts)
    }
    given: dict[str, list[str]] = {}
    tokens = iter(args)
    for token in tokens:
        if token == "--":
            break
        name, has_value, value = token.partition("=")
        param = options.get(name if token.startswith("--") else token)
        if param is None:
            continue
        if not (param.is_flag or has_value):
            value = next(tokens, "")
        typed = given.setdefault(param.name, [])
        typed.append(f"{name} {value}".strip() if not param.is_flag else name)
        if len(typed) > 1:
            raise click.UsageError(f"{name} is given more than once ({', then '.join(typed)}); give it once")


class _Commands(click.Group):
    """The command group: a :class:`CorpError` becomes its message and exit status, a setting's
    name in it becomes its option, and running out of memory, a failing file system (no space,
    no permission) or a dependency missing from the installation becomes one message too. Other
    exceptions are bugs: one line says so (``CORP_DEPLOY_DEBUG=1`` shows the traceback)."""

    command_class = _Command

    def parse_args(self, ctx, args):
        ctx.meta[COMMAND_LINE] = list(args)  # as typed, for commands that print a command to run again
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        with noting_outputs() as noted:
            try:
                return super().invoke(ctx)
            except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
                raise
            except Interrupted as exc:
                exc.completed = tuple(noted.in_place())  # the entry point says what was written, and not
                exc.abandoned = tuple(noted.left_behind())
                raise
            except Exception as exc:
                done = noted.in_place()
                message, exit_code = _failure(exc, completed=bool(done), command=ctx.invoked_subcommand, noted=noted)
        if done:
            raise _click_error(
                f"{', '.join(map(str, done))} {'is' if len(done) == 1 else 'are'} complete (written before the "
                f"failure), but a later step failed: {message}",
                EXIT_OUTPUT_COMPLETE,
            )
        raise _click_error(message, exit_code)


def _failure(
    exc: Exception, completed: bool, command: str | None = None, noted: NotedOutputs | None = None
) -> tuple[str, int]:
    """The one message and the exit status of ``command`` that raised ``exc`` (see :class:`_Commands`),
    ``completed`` when it had put an output in place before; ``noted``: what it did to its outputs
    (those it was writing, and the file systems found full then, name where a refused write went)."""
    if isinstance(exc, SettingError):
        return exc.naming(lambda setting: option_name(setting, command)), exc.exit_code
    if isinstance(exc, CorpError):
        return str(exc), exc.exit_code
    memory = _out_of_memory(exc)
    if memory:
        return f"ran out of memory ({memory}); use fewer images or smaller batches", EXIT_FAILURE
    refused = file_system_refusal(exc)
    if refused:
        partial = "" if completed else "; nothing partial was left behind"
        where = _where_refused(exc, noted or NotedOutputs())
        return f"the file system refused: {refused}{where}{partial}", EXIT_FAILURE
    missing = _missing_dependency(exc)
    if missing:
        return (
            f"the Python module '{missing}' is not installed, and this command needs it: "
            "install corp-deploy with its dependencies (pip install without --no-deps)",
            EXIT_FAILURE,
        )
    from ..distributed import lost_peer

    if lost_peer(exc):
        return (
            "another process of this torchrun job stopped (its message says why); this one stopped with it, "
            "and no artifact was written",
            EXIT_FAILURE,
        )
    if os.environ.get("CORP_DEPLOY_DEBUG"):
        raise exc
    return (
        f"internal error ({type(exc).__name__}: {first_line(exc)}); this is a bug in corp-deploy: rerun with "
        "CORP_DEPLOY_DEBUG=1 for the traceback and report it",
        EXIT_FAILURE,
    )


def _out_of_memory(exc: Exception) -> str | None:
    """What ran out of memory, in words, or None for another failure: Python's MemoryError, torch's
    out-of-memory errors (raised as RuntimeErrors), and ONNX Runtime's failed allocations (raised as
    its own types, from ``onnxruntime.capi.onnxruntime_pybind11_state``, with its source locations:
    ``... running Add node. Name:'node_linear' Status Message: .../bfc_arena.cc:360 ... Failed to
    allocate memory for requested buffer of size 641728512``)."""
    if (
        isinstance(exc, MemoryError)
        or type(exc).__name__ == "OutOfMemoryError"
        or (isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))
    ):
        return first_line(exc)
    text = str(exc)
    if not (type(exc).__module__.startswith("onnxruntime") and "Failed to allocate memory" in text):
        return None
    size = re.search(r"buffer of size (\d+)", text)
    op = re.search(r"running (\w+) node", text)
    return f"ONNX Runtime could not allocate {size_in_words(int(size[1])) if size else 'memory'}" + (
        f" while running its {op[1]} node" if op else ""
    )


#: The OS errors of a file system that refuses a write or a read, as libraries that wrap them in
#: their own exception types still quote them (safetensors: ``IoError(Os { code: 28, kind:
#: StorageFull, message: "No space left on device" })``).
_FILE_SYSTEM_ERRNOS = (
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EFBIG,
    errno.EROFS,
    errno.EIO,
    errno.EACCES,
    errno.EPERM,
    errno.EMFILE,
    errno.ENAMETOOLONG,
)
#: Library messages of a failed write that name no OS error (torch.save's stream writer).
_FAILED_WRITES = ("file write failed",)


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and its explicit causes (``raise ... from``), outermost first."""
    chain, seen = [], exc
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__
    return chain


def file_system_refusal(exc: BaseException) -> str | None:
    """What the file system refused, in words (``No space left on device (PATH)``), when ``exc``
    is an OS error or wraps one: as its cause, or quoted in the message of a library's
    own exception type (safetensors, torch.save, the ONNX exporters). None for anything else."""
    chain = _causes(exc)
    for error in chain:
        if isinstance(error, OSError) and error.errno is not None:
            return f"{error.strerror or error}" + (f" ({error.filename})" if error.filename else "")
    text = " ".join(str(error) for error in chain)
    library = type(exc).__module__.split(".")[0]
    for code in _FILE_SYSTEM_ERRNOS:
        if os.strerror(code) in text:
            return f"{os.strerror(code)} (reported by {library})"
    if any(failure in text for failure in _FAILED_WRITES):
        return f"a write failed, the disk may be full (reported by {library})"
    return None


def _where_refused(exc: BaseException, noted: NotedOutputs) -> str:
    """Where a write the file system refused was going, in words (to follow its message): the outputs
    being written (unless the refused file is named and lies elsewhere: an input); and, when it was
    refused room (:data:`_NO_ROOM`), the folders whose file system was full when they were abandoned
    (:func:`~corp_deploy.outputs.full_folders`), or else the temporary directory when the refused
    file lies in it, outside the outputs' staging folders. The temporary directory is named as
    ``$TMPDIR``, with what to do about it."""
    temporary = None
    with contextlib.suppress(OSError):  # no usable temporary directory at all
        temporary = Path(tempfile.gettempdir())
    refused, room = _refused_file(exc), _refused_room(exc)
    staged = refused is not None and any(staging in refused.parents for _, _, staging in noted.abandoned)
    in_temporary = room and refused is not None and not staged and temporary in refused.parents
    writing = noted.being_written() if refused is None or staged or in_temporary else []
    said = f" while writing {', '.join(map(str, writing))}" if writing else ""
    if not room:
        return said
    full = [f"the temporary directory $TMPDIR ({f})" if f == temporary else str(f) for f in noted.full]
    if full:
        said += f"; the file system of {' and of '.join(full)} {'is' if len(full) == 1 else 'are'} full"
    elif in_temporary:
        said += f"; the file was in the temporary directory $TMPDIR ({temporary})"
    if in_temporary or temporary in noted.full:
        said += " (free space there, or point TMPDIR at a larger disk)"
    return said


#: The OS errors of a write refused room: a full disk, a quota, the file size limit (``ulimit -f``).
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _refused_room(exc: BaseException) -> bool:
    """Whether ``exc`` is, or wraps or quotes, an OS error of :data:`_NO_ROOM`, or a library's failed
    write that names none (:data:`_FAILED_WRITES`: most likely a full disk)."""
    chain = _causes(exc)
    if any(isinstance(error, OSError) and error.errno in _NO_ROOM for error in chain):
        return True
    text = " ".join(str(error) for error in chain)
    return any(os.strerror(code) in text for code in _NO_ROOM) or any(f in text for f in _FAILED_WRITES)


def _refused_file(exc: BaseException) -> Path | None:
    """The absolute path an OS error in ``exc``'s causes names, or None (a relative one says not where)."""
    named = [Path(e.filename) for e in _causes(exc) if isinstance(e, OSError) and isinstance(e.filename, str)]
    return named[0] if named and named[0].is_absolute() else None


def _missing_dependency(exc: Exception) -> str | None:
    """The top-level module of a failed import of another library (None for anything else: a
    module of corp-deploy's own that cannot be imported is a bug)."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    return None if re.match(OWN_MODULES, exc.name) else exc.name.split(".")[0]


def _click_error(message: str, exit_code: int) -> click.ClickException:
    error = click.ClickException(message)
    error.exit_code = exit_code
    return error


@click.group(
    cls=_Commands,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="\b\nExit status of every command:\n"
    + "\n".join(f"  {code!s:>5}  {meaning}" for code, meaning in EXIT_CODES.items()),
)
@click.version_option(version=__version__)
@click.pass_context
def cli(ctx):
    """Compress timm Vision Transformers one-shot with CORP and ship them.

    \b
    Typical use:
      corp-deploy compress deit_base --s 0.5 && corp-deploy export --trt
      corp-deploy compress deit_small --s-mlp 0.5 --s-attn 0.3 --calib ./images
    """
    from ..distributed import launched_by_torchrun

    if launched_by_torchrun() and ctx.invoked_subcommand not in ("compress", "sweep"):
        raise CorpError(
            f"only compress and sweep run under torchrun (their calibration is shared by the "
            f"processes); run {ctx.invoked_subcommand} in one process"
        )
