"""What several commands share: warnings, input folders kept apart from outputs, and the dense
model built from the model-source options."""

from __future__ import annotations

import contextlib
import errno
import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import click

from ..cost import share_text
from ..errors import BadUsage, CorpError
from .group import COMMAND_LINE
from .options import parse_model_args

#: Where outputs go without -o.
DEFAULT_OUTPUT_ROOT = Path("corp-deploy")


@contextlib.contextmanager
def results_output() -> Iterator:
    """The rich console a command prints its results on (the standard output). When that cannot
    be written (a closed pipe, a full disk), CorpError saying so: the output written before is
    complete, which the command group then says (:func:`corp_deploy.outputs.noting_outputs`)."""
    from rich.console import Console

    class Terminal(Console):
        def on_broken_pipe(self) -> None:  # rich's own answer: exit 1 in silence
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    try:
        yield Terminal()
    except OSError as exc:
        with contextlib.suppress(OSError, ValueError, AttributeError):  # no failing flush at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise CorpError(f"printing the results on the standard output failed ({exc.strerror or exc})") from None


def warn(message: str | None) -> None:
    if message:
        click.secho(f"warning: {message}", fg="yellow", err=True)


def given_on_command_line(parameter: str) -> bool:
    """Whether the running command's ``parameter`` was given on the command line (not defaulted)."""
    return click.get_current_context().get_parameter_source(parameter) == click.core.ParameterSource.COMMANDLINE


def check_torch_options_apply(families: tuple[str, ...]) -> None:
    """BadUsage when ``--torch-precision`` or ``--cuda-graphs`` is given without a PyTorch backend
    family among ``families`` (``torch``, ``torch-compile``): it would change nothing that is timed;
    and when ``--cuda-graphs`` is given where PyTorch sees no CUDA GPU: nothing could replay them."""
    options = {"torch_precision": "--torch-precision", "cuda_graphs": "--cuda-graphs"}
    named = [option for name, option in options.items() if given_on_command_line(name)]
    if named and not {"torch", "torch-compile"} & set(families):
        raise BadUsage(
            f"{' and '.join(named)} {'applies' if len(named) == 1 else 'apply'} only with the torch backends "
            "(--backends torch,... or torch-compile,...)"
        )
    if "--cuda-graphs" in named:
        import torch  # loaded only here: the other commands' checks need no torch

        if not torch.cuda.is_available():
            raise BadUsage("--cuda-graphs replays CUDA graphs on a CUDA GPU, and PyTorch sees none here")


def check_recovery_options_apply(steps: int) -> None:
    """BadUsage when ``--recover-*`` options are given while no recovery runs (``steps`` 0): they
    would do nothing."""
    from ..recovery import RecoveryConfig

    named = [
        "--" + name.replace("_", "-")
        for name in RecoveryConfig.setting_names()
        if name != "recover_steps" and given_on_command_line(name)
    ]
    if named and not steps:
        raise BadUsage(f"{', '.join(named)} {'applies' if len(named) == 1 else 'apply'} only with --recover-steps N")


def command_to_paste(*, argument: str | Path | None = None) -> str:
    """The running command as the user typed it, shell-quoted so that it is safe to paste (a path
    with a space, quotes or ``$(...)`` stays one word and runs nothing). ``argument``: a positional
    argument inserted after the command's name (the artifact a command chose by itself)."""
    words = ["corp-deploy", *click.get_current_context().find_root().meta[COMMAND_LINE]]
    if argument is not None:
        words.insert(2, str(argument))
    return shlex.join(words)


def nothing_pruned_warning(dense_macs: int, compressed_macs: int, budget: float | None) -> str | None:
    """The warning for a compression that kept every dim, or None when it pruned something.

    Told by the outcome, the MACs per image of the dense and the compressed model (every pruned dim
    removes MACs, so equal counts mean the model is the dense one), not by the settings: sparsities
    of 0 and any MAC budget the dense model fits (``--macs 1``, ``--speedup 1``, or a budget that
    rounds to the dense MACs) are told alike. ``budget``: the budget's fraction of the dense MACs
    (the compress report's ``budget.macs_fraction``), None for sparsities."""
    if compressed_macs < dense_macs:
        return None
    why = (
        "every sparsity is 0"
        if budget is None
        else f"the MAC budget ({share_text(budget)} of the dense MACs) fits the dense model, so no unit was pruned"
    )
    return (
        f"{why}: every dim is kept, and the artifact is the dense model (the exactness check; useful as "
        "a dense reference), not a compressed one"
    )


def warn_builtin_calibration() -> None:
    warn(
        "no --calib given; calibrating on built-in photos. Images from your deployment distribution give "
        "better accuracy."
    )


def input_dir(path: Path | None, option: str) -> Path | None:
    """An input directory option, absolute (:func:`corp_deploy.files.existing_dir`); None if not given."""
    from ..files import existing_dir

    return None if path is None else existing_dir(path, option)


def check_output_paths(outputs: list[Path], inputs: dict[str, Path | None], *, records_state: bool = False) -> None:
    """:func:`corp_deploy.outputs.check_apart` and, for a command that ``records_state`` (compress),
    CorpError when the state folder lies inside its output (it would become a file the output's
    record does not list)."""
    from ..latest import state_dir
    from ..outputs import check_apart

    check_apart(outputs, inputs)
    state = state_dir() if records_state else None
    if state is None:
        return
    state = state.resolve()
    for output in outputs:
        if state == output or output in state.parents:
            raise CorpError(
                f"the state folder {state} lies inside {output}; choose another -o (or set "
                "CORP_DEPLOY_STATE_DIR elsewhere)"
            )


def dense_model(model: str, model_args: tuple[str, ...], checkpoint: Path | None, no_pretrained: bool, seed: int):
    """Check the model-source options and build the dense model; returns it and its artifact record."""
    from ..base_model import base_model_spec, weights_record
    from ..models import create_base_model, resolve_model_name, timm_arguments

    kwargs = parse_model_args(model_args)
    if checkpoint is not None and no_pretrained:
        raise BadUsage("--checkpoint and --no-pretrained exclude each other")
    if checkpoint is not None and not checkpoint.is_file():
        raise CorpError(f"--checkpoint {checkpoint}: {'not a file' if checkpoint.exists() else 'not found'}")
    full_name = resolve_model_name(model, kwargs)
    click.echo(f"building {full_name} ...", err=True)
    base = create_base_model(full_name, kwargs, pretrained=not no_pretrained, checkpoint=checkpoint, seed=seed)
    record = {
        **base_model_spec(base, full_name, timm_arguments(full_name, kwargs)[1]),
        "weights": weights_record(checkpoint, not no_pretrained, seed, name=full_name),
    }
    return base, record
