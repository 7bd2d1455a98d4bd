"""``corp-deploy export``: ONNX (fp32, fp16, bf16, int8) and TensorRT, with parity gates."""

from __future__ import annotations

import shlex
import sys
from dataclasses import replace

import click

from exporters.int8_options import Int8Options
from exporters.onnx_export import DEFAULT_EXPORTER, DEFAULT_OPSET, EXPORTERS
from exporters.precision import PRECISIONS
from exporters.quantize import ACTIVATION_TYPES, CALIBRATION_METHODS
from exporters.tensorrt import BatchProfile

from ..errors import EXIT_INCOMPLETE, BadUsage
from .common import check_output_paths, command_to_paste, given_on_command_line, input_dir, results_output, warn
from .group import cli
from .options import IMAGE_COUNT, PATH, keep_float_count, smoothing_strength

INT8_DEFAULTS = Int8Options()


def default_limits(limit: str) -> str:
    """What ``--help`` says of the default of one parity limit (a :class:`exporters.parity.Tolerance`
    field, ``atol``, ``min_cosine`` or ``min_top1``): each precision record's value, or that it is not checked."""
    values = {name: getattr(precision.tolerance, limit) for name, precision in PRECISIONS.items()}
    unchecked = [name for name, value in values.items() if value is None]
    said = [f"{value:g} {name}" for name, value in values.items() if value is not None]
    return ", ".join(said + ([f"not checked for {'/'.join(unchecked)}"] if unchecked else []))


@cli.command()
@click.argument("artifact", required=False, type=PATH)
@click.option(
    "--trt",
    is_flag=True,
    help="Also build TensorRT engines (needs TensorRT and a CUDA GPU; build_engine.sh is written either way).",
)
@click.option("--dense", is_flag=True, help="Also export the unpruned base model (dense.onnx) the same way.")
@click.option("--opset", type=int, default=DEFAULT_OPSET, show_default=True, help="ONNX opset.")
@click.option(
    "--exporter", type=click.Choice(EXPORTERS), default=DEFAULT_EXPORTER, show_default=True, help="torch.onnx exporter."
)
@click.option(
    "--batch",
    "batch",
    default=str(BatchProfile()),
    show_default=True,
    metavar="MIN:OPT:MAX",
    help="TensorRT optimisation profile of the batch axis (the ONNX batch axis is dynamic).",
)
@click.option(
    "--precision",
    type=click.Choice(tuple(PRECISIONS)),
    default="fp32",
    show_default=True,
    help="Precision written into the graph; LayerNorm, softmax and the patch embedding stay fp32 "
    "(int8: a QDQ graph, Linear layers in int8).",
)
@click.option(
    "--int8-calibration",
    type=click.Choice(tuple(CALIBRATION_METHODS)),
    default=INT8_DEFAULTS.calibration,
    show_default=True,
    help="int8: how activation ranges are set from the calibration images.",
)
@click.option(
    "--int8-keep-float",
    default=str(INT8_DEFAULTS.keep_float),
    show_default=True,
    metavar="auto|N",
    callback=keep_float_count,
    help="int8: keep N Linear layers in float, those whose int8 rounding errs most; auto: the fewest "
    "(0, 1, 2, 4, ... up to a quarter) that meet the gate's tolerance on the calibration images, a "
    "quarter of them held back from the ranges.",
)
@click.option(
    "--int8-smoothing",
    default=str(INT8_DEFAULTS.smoothing),
    show_default=True,
    metavar="ALPHA|none",
    callback=smoothing_strength,
    help="int8: move outlier channels of each Linear layer's input into its weight before quantizing "
    "(exact in float; scale peak^ALPHA / weight peak^(1-ALPHA) per channel); none: off.",
)
@click.option(
    "--int8-activations",
    type=click.Choice(ACTIVATION_TYPES),
    default=INT8_DEFAULTS.activations,
    show_default=True,
    help="int8: the Linear layers' inputs as signed int8 with symmetric ranges (every runtime, "
    "TensorRT included) or unsigned with asymmetric ranges (ONNX Runtime on x86 CPUs: faster; "
    "not with --trt).",
)
@click.option(
    "--calib",
    type=PATH,
    default=None,
    help="int8: calibration image directory. [default: what compress used, from config.json]",
)
@click.option(
    "--calib-samples",
    type=IMAGE_COUNT,
    default=None,
    help="int8: number of calibration images. [default: as many as compress used]",
)
@click.option(
    "--workspace",
    "workspace_gb",
    type=float,
    default=None,
    metavar="GB",
    help="TensorRT builder workspace limit. [default: TensorRT's]",
)
@click.option(
    "--timing-cache",
    type=PATH,
    default=None,
    help="TensorRT timing cache: read if it exists, updated after the build.",
)
@click.option(
    "--atol",
    type=float,
    default=None,
    help=f"Parity gate: max abs error vs the reference. [default: {default_limits('atol')}]",
)
@click.option(
    "--min-cosine",
    type=float,
    default=None,
    help=f"Parity gate: smallest per-image cosine. [default: {default_limits('min_cosine')}]",
)
@click.option(
    "--min-top1",
    type=float,
    default=None,
    help="Parity gate: smallest top-1 agreement (the dense model's classes; refused for a model without a "
    "classifier, whose features --min-cosine gates). "
    f"[default: {default_limits('min_top1')}]",
)
@click.option(
    "-o",
    "--output",
    type=PATH,
    default=None,
    help="Export directory. [default: ARTIFACT/export-<precision>]",
)
def export(
    artifact,
    trt,
    dense,
    opset,
    exporter,
    batch,
    precision,
    workspace_gb,
    timing_cache,
    atol,
    min_cosine,
    min_top1,
    output,
    **int8_options,
):
    """Export a compressed artifact to ONNX (and TensorRT), with parity gates.

    Every ONNX file is checked against the PyTorch model on calibration-like images at batch
    sizes 1 and 8, every TensorRT engine against ONNX Runtime; a failed gate writes nothing.
    Without ARTIFACT, the most recent one written by `compress` is used.

    \b
    Exit status: 0 done; 1 error; 2 bad usage; 3 files written but not finished here (no
    TensorRT or no CUDA GPU for the engines, or a bf16 graph nothing here can check: finish on
    the target, e.g. with build_engine.sh); 4 parity gate failed (nothing written); 5 the export
    is complete but a step after it failed; 128 + N stopped by signal N (130 Ctrl-C, 143 SIGTERM;
    `corp-deploy --help` lists every status).

    \b
    Examples:
      corp-deploy export --trt
      corp-deploy export corp-deploy/deit_base-s0.5 --dense --precision fp16 -o out/deit_base-fp16
      corp-deploy export corp-deploy/deit_base-s0.5 --dense --precision int8 --calib ./images
      corp-deploy export --trt --batch 1:16:64 --workspace 4 --timing-cache ~/.cache/trt.cache
    """

    from exporters.options import ExportOptions
    from exporters.parity import Tolerance
    from exporters.pipeline import default_export_dir, export_artifact, gate_tolerance

    from ..artifact import Artifact
    from ..calibration import summary_warnings
    from ..latest import latest_artifact
    from ..outputs import resolve

    record, fields = PRECISIONS[precision], Int8Options.keywords()
    takes_int8 = record.options_class is Int8Options
    _check_int8_options_apply(takes_int8)
    if int8_options.get("calib") is not None:  # named as typed (the library names its field)
        int8_options["calib"] = input_dir(int8_options["calib"], "--calib")
    chosen = artifact is None
    if chosen:
        artifact = latest_artifact()
        click.echo(f"exporting the most recent artifact: {artifact}", err=True)
    limits = {
        name: value
        for name, value in (("atol", atol), ("min_cosine", min_cosine), ("min_top1", min_top1))
        if value is not None
    }
    Tolerance(**limits)  # a limit out of range: refused before the model is loaded
    options = ExportOptions(
        trt=trt,
        dense=dense,
        opset=opset,
        exporter=exporter,
        precision=precision,
        batch=BatchProfile.parse(batch),
        workspace_gb=workspace_gb,
        timing_cache=timing_cache,
        int8=Int8Options(**{fields[k]: v for k, v in int8_options.items()}) if takes_int8 else None,
    )
    if given_on_command_line("batch") and not trt:  # the profile of the engines; nothing else reads it
        raise BadUsage("--batch is the TensorRT engines' batch profile; it applies only with --trt")
    calib = {}
    if options.int8 is not None:  # the images int8 ranges are read from: given, or the artifact's own
        artifact = Artifact.read(artifact)  # read once: export_artifact is given it
        calib = _int8_calibration_folder(artifact, options.int8)
    check_output_paths([resolve(output or default_export_dir(artifact, precision))], calib)
    if limits:  # the defaults the model's outputs can be measured on, each limit given in its default's place
        artifact = Artifact.of(artifact)  # its model loaded once, here, and exported (it tells a classifier)
        options = replace(options, tolerance=gate_tolerance(record, artifact.model.num_classes > 0, **limits))
    result = export_artifact(artifact, output, options, log=lambda message: click.echo(message, err=True))
    int8 = result.manifest.models["model"].int8
    for message in summary_warnings(int8["source"]) if int8 else ():
        warn(message)
    with results_output() as console:
        console.print(result.summary_table())
    if result.incomplete:
        _say_how_to_finish(result, trt, artifact if chosen else None)
        sys.exit(EXIT_INCOMPLETE)


def _check_int8_options_apply(takes_int8: bool) -> None:
    """BadUsage when ``--int8-*``, ``--calib`` or ``--calib-samples`` are given with a precision that
    does not take them (``takes_int8`` False), even at their default values: a script that names
    them expects them to matter."""
    flags, fields = Int8Options.flags(), Int8Options.keywords()
    named = [flags[field] for keyword, field in fields.items() if given_on_command_line(keyword)]
    if named and not takes_int8:
        raise BadUsage(f"{', '.join(named)} {'applies' if len(named) == 1 else 'apply'} only with --precision int8")


def _int8_calibration_folder(artifact, int8: Int8Options) -> dict:
    """The folder the int8 ranges are read from (``int8.calib``, or the artifact's own calibration
    source), by the name a message gives it: the export must not lie in it."""
    from ..calibration import CalibrationSpec

    source = CalibrationSpec.recorded(artifact.config.calibration, artifact.config.settings, source=int8.calib).source
    return {"--calib" if int8.calib is not None else "the artifact's calibration folder": source}


def _say_how_to_finish(result, trt: bool, chosen_artifact) -> None:
    """What the export left undone here (``result.incomplete``) and the command that finishes it on
    a machine that can (``chosen_artifact``: the artifact the command chose, written into it)."""
    from exporters.tensorrt import INSTALL_HINT, SCRIPT_NAME

    for reason in result.incomplete:
        click.secho(f"not done here: {reason}", fg="yellow", err=True)
    command = command_to_paste(argument=chosen_artifact)
    if trt and not result.manifest.tensorrt["built"]:
        click.echo(
            f"To build the engines on the target GPU machine, either run this command there (it builds "
            f"and checks them)\n"
            f"  {INSTALL_HINT} && {command}\n"
            f"or, with TensorRT's trtexec there,\n"
            f"  bash {shlex.quote(str(result.out_dir / SCRIPT_NAME))}",
            err=True,
        )
    else:
        click.echo(
            "To finish on a machine with a CUDA GPU and ONNX Runtime's CUDA provider (the onnxruntime-gpu "
            f"that corp-deploy installs on Linux x86-64; TensorRT is not needed), run this command there:\n"
            f"  {command}",
            err=True,
        )
