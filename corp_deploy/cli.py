"""The ``corp-deploy`` command line: a thin layer over the library.

Every failure reaches the user as one message and an exit status (:data:`EXIT_CODES`), never a
traceback: bad input and refusals are :class:`CorpError`, running out of memory is handled here,
and interrupts (SIGINT, SIGTERM) by the entry point, :mod:`corp_deploy.launch`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import click

from exporters.onnx_export import DEFAULT_EXPORTER, DEFAULT_OPSET, EXPORTERS
from exporters.precision import EXPORT_PRECISIONS
from exporters.quantize import CALIBRATION_METHODS, DEFAULT_CALIBRATION
from exporters.tensorrt import BatchProfile

from . import __version__
from .config import (BUDGET_RANKER, CALIBRATION_MODES, DEFAULT_SPARSITY, RANKERS, TARGETS, UNIFORM_RANKER,
                     CompressConfig)
from .errors import CorpError, SettingError, first_line
from .methods import METHODS, option_owners

#: CompressConfig's defaults, read from its fields (nothing is built or validated at import).
DEFAULTS = {field.name: field.default for field in dataclasses.fields(CompressConfig)}
DEFAULT_OUTPUT_ROOT = Path("corp-deploy")
#: Exit statuses of every command (README, "Guarantees").
EXIT_CODES = {0: "done", 1: "error: bad input, a refusal, or a failure; nothing half-written", 2: "bad usage",
              3: "export: files written, a step needs TensorRT or a GPU to finish",
              4: "a gate failed (export: nothing written; bench: reports written)",
              130: "interrupted by SIGINT", 143: "terminated by SIGTERM"}
#: Settings (CompressConfig fields) whose option is not ``--<field with dashes>``.
_SETTING_OPTIONS = {"compensation": "--no-compensation"}
#: The largest seed every random generator used here accepts.
MAX_SEED = 2 ** 32 - 1


class _FiniteFloatRange(click.FloatRange):
    """A float range that refuses NaN and infinities (click's ranges let NaN through)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{number} is not a finite number", param, ctx)
        return number


#: How many images an option may ask for (a decoded 224 px image is 0.6 MB).
IMAGE_COUNT = click.IntRange(1, 10_000_000)
#: CPU threads: at most four per core (more only slows the run, and far more crashes the runtimes).
THREADS = click.IntRange(1, 4 * (os.cpu_count() or 1))
#: A positive, finite number of seconds.
SECONDS = _FiniteFloatRange(min=0, min_open=True)


def option_name(setting: str) -> str:
    """The command-line option of a setting: ``s_mlp`` -> ``--s-mlp``."""
    return _SETTING_OPTIONS.get(setting, "--" + setting.replace("_", "-"))


class _Commands(click.Group):
    """The command group: a :class:`CorpError` becomes its message and exit status, a setting's
    name in it becomes its option, and running out of memory or a failing file system (no space,
    no permission) becomes one message too. Other exceptions are bugs: one line says so
    (``CORP_DEPLOY_DEBUG=1`` shows the traceback)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except SettingError as exc:
            raise _click_error(exc.naming(option_name), exc.exit_code) from None
        except CorpError as exc:
            raise _click_error(str(exc), exc.exit_code) from None
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:
            if _out_of_memory(exc):
                raise _click_error(f"ran out of memory ({first_line(exc)}); use fewer images or smaller batches",
                                   1) from None
            if isinstance(exc, OSError) and exc.errno is not None:
                where = f" ({exc.filename})" if exc.filename else ""
                raise _click_error(f"the file system refused: {exc.strerror or exc}{where}; nothing partial was "
                                   "left behind", 1) from None
            if os.environ.get("CORP_DEPLOY_DEBUG"):
                raise
            raise _click_error(f"internal error ({type(exc).__name__}: {first_line(exc)}); "
                               "this is a bug in corp-deploy: rerun with CORP_DEPLOY_DEBUG=1 for the traceback "
                               "and report it", 1) from None


def _out_of_memory(exc: Exception) -> bool:
    """Python's MemoryError, and torch's out-of-memory errors (raised as RuntimeErrors)."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def _click_error(message: str, exit_code: int) -> click.ClickException:
    error = click.ClickException(message)
    error.exit_code = exit_code
    return error


def _keep_float_count(ctx, param, value: str) -> int | str:
    """``--int8-keep-float``: ``auto`` or a count >= 0."""
    if value == "auto":
        return value
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise click.BadParameter(f"expected 'auto' or a number >= 0, got {value!r}")
    return count


def _parse_model_args(pairs: tuple[str, ...]) -> dict:
    """``KEY=VALUE`` strings to a dict; values are parsed as JSON when they can be."""
    out = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise CorpError(f"--model-arg expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def default_output_dir(model: str, config: CompressConfig) -> Path:
    """``./corp-deploy/<model>[-<method>]-<tag>``: the tag is ``macs<F>`` or ``x<speedup>`` for a
    budget, else ``s<S>`` (prefixed by the target unless it is ``both``), or the sparsity of each
    part when they differ (``mlp0.5-attn0.3``)."""
    if config.has_budget:
        tag = f"macs{config.macs:g}" if config.macs is not None else f"x{config.speedup:g}"
        if config.target != "all":
            tag = f"{config.target}-{tag}"
    else:
        sparsity = {"mlp": config.s_mlp, "qk": config.s_attn, "vo": config.s_vo}
        values = [sparsity[part] for part in config.parts]
        if len(set(values)) == 1:
            tag = f"s{values[0]:g}" if config.target == "both" else f"{config.target}-s{values[0]:g}"
        else:
            tag = "-".join(f"{ {'qk': 'attn'}.get(part, part)}{sparsity[part]:g}" for part in config.parts)
    method = "" if config.method == "corp" else f"-{config.method}"
    suffix = "" if config.compensation else "-nocomp"
    return DEFAULT_OUTPUT_ROOT / f"{model.replace('/', '_')}{method}-{tag}{suffix}"


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]},
             epilog="\b\nExit status of every command:\n" + "\n".join(f"  {code:>3}  {meaning}"
                                                                    for code, meaning in EXIT_CODES.items()))
@click.version_option(version=__version__)
def cli():
    """Compress timm Vision Transformers one-shot with CORP and ship them.

    \b
    Typical use:
      corp-deploy compress deit_base --s 0.5 && corp-deploy export --trt
      corp-deploy compress deit_small --s-mlp 0.5 --s-attn 0.3 --calib ./images
    """


def _options(*options):
    """Apply click options in the order listed (so they appear in that order in --help)."""
    def apply(func):
        for option in reversed(options):
            func = option(func)
        return func
    return apply


#: Which dense model to start from and what to calibrate on (shared by compress and sweep).
_model_source_options = _options(
    click.argument("model"),
    click.option("--target", type=click.Choice(TARGETS), default=None,
                 help="Which parts to prune. [default: the method's: "
                      + ", ".join(f"{m.default_target} for {m.name}" for m in METHODS.values()) + "]"),
    click.option("--calib", type=click.Path(path_type=Path), default=None,
                 help="Directory of unlabelled deployment images (recursive; jpg/png/webp/bmp). "
                      "Default: built-in photos from scikit-image."),
    click.option("--calib-samples", type=IMAGE_COUNT, default=256, show_default=True,
                 help="Number of calibration images."),
    click.option("--model-arg", "model_args", multiple=True, metavar="KEY=VALUE",
                 help="timm creation argument, repeatable (e.g. img_size=224, num_classes=0)."),
    click.option("--checkpoint", type=click.Path(path_type=Path), default=None,
                 help="Local weights: .safetensors, or .pth/.pt state dict (loaded with weights_only=True)."),
    click.option("--no-pretrained", is_flag=True, help="Random weights (for trying the tool)."),
    click.option("--seed", type=click.IntRange(0, MAX_SEED), default=0, show_default=True,
                 help="Seed for calibration sampling/augmentation and random weights."),
)


def input_dir(path: Path | None, option: str) -> Path | None:
    """An input directory option, absolute (:func:`corp_deploy.files.existing_dir`); None if not given."""
    from .files import existing_dir
    return None if path is None else existing_dir(path, option)


def check_apart(outputs: list[Path], inputs: dict[str, Path | None], *, records_state: bool = False) -> None:
    """CorpError when an output path lies inside an input folder (the next run would read the tool's
    own files as images) or, for a command that ``records_state`` (compress), the state folder lies
    inside its output (it would become a file the output's record does not list)."""
    from .artifact import state_dir
    state = state_dir().resolve()
    for output in outputs:
        for option, folder in inputs.items():
            if folder is not None and (output == folder or folder in output.parents):
                raise CorpError(f"{output} lies inside {option} {folder}; write outputs outside the image folders")
        if records_state and (state == output or output in state.parents):
            raise CorpError(f"the state folder {state} lies inside {output}; choose another -o (or set "
                            "CORP_DEPLOY_STATE_DIR elsewhere)")


def _dense_model(model: str, model_args: tuple[str, ...], checkpoint: Path | None, no_pretrained: bool,
                 seed: int):
    """Check the model-source options and build the dense model; returns it and its artifact record."""
    from .artifact import base_model_spec, weights_record
    from .models import create_base_model, resolve_model_name

    kwargs = _parse_model_args(model_args)
    if checkpoint is not None and no_pretrained:
        raise CorpError("--checkpoint and --no-pretrained exclude each other")
    if checkpoint is not None and not checkpoint.is_file():
        raise CorpError(f"--checkpoint {checkpoint}: {'not a file' if checkpoint.exists() else 'not found'}")
    full_name = resolve_model_name(model, kwargs)
    click.echo(f"building {full_name} ...", err=True)
    base = create_base_model(full_name, kwargs, pretrained=not no_pretrained, checkpoint=checkpoint, seed=seed)
    record = {**base_model_spec(base, full_name, kwargs), "weights": weights_record(checkpoint, not no_pretrained, seed)}
    return base, record


@cli.command()
@_model_source_options
@click.option("--method", type=click.Choice(tuple(METHODS)), default=DEFAULTS["method"], show_default=True,
              help=" ".join(f"{m.name}: {m.summary}" for m in METHODS.values()) + " All one-shot.")
@click.option("--s", "sparsity", type=float, default=None,
              help=f"Sparsity in [0, 1) of every pruned part in every block (vbp: global MLP rate). "
                   f"[default: {DEFAULT_SPARSITY} without a budget]")
@click.option("--s-mlp", type=float, default=None, help="MLP hidden-channel sparsity (overrides --s).")
@click.option("--s-attn", type=float, default=None,
              help="Attention sparsity (overrides --s): query/key dims (corp), query/key and value dims "
                   "(toast); vbp has none.")
@click.option("--s-vo", type=float, default=None,
              help="corp: value/output dim sparsity (overrides --s; needs --target vo, mlp-vo or all).")
@click.option("--macs", type=float, default=None, metavar="F",
              help="corp: MAC budget, keep at most the fraction F of the dense MACs; every block's parts "
                   "get the sizes that CORP's closed-form errors say hurt least. Excludes --s*.")
@click.option("--speedup", type=float, default=None, metavar="X",
              help="corp: MAC budget as a MAC-ideal speedup (the same as --macs 1/X).")
@click.option("--unit-floor", type=float, default=DEFAULTS["unit_floor"], show_default=True,
              help="corp, budget: every MLP and every block's query/key or value dims keep at least this "
                   "fraction.")
@click.option("--equal-head-dims", is_flag=True,
              help="corp: as many value as query/key dims in every head (fused attention kernels need "
                   "equal head dims); needs --target all.")
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True,
              help="Calibration batch size.")
@click.option("--ranker", type=click.Choice(RANKERS), default=None,
              help=f"corp: MLP hidden and value channel selection. [default: {UNIFORM_RANKER} with --s, "
                   f"{BUDGET_RANKER} with a budget]")
@click.option("--ridge", type=float, default=DEFAULTS["ridge"], show_default=True,
              help="corp: scale-free ridge alpha (lambda = alpha times the layer's mean channel variance).")
@click.option("--calibration", type=click.Choice(CALIBRATION_MODES), default=DEFAULTS["calibration"],
              show_default=True, help="Statistics all from the dense model (independent, as in the "
                                      "paper) or from the partly compressed model (sequential).")
@click.option("--round-to", type=click.IntRange(min=1), default=1, show_default=True,
              help="Round kept dims to a multiple of this (e.g. 8 for tensor cores).")
@click.option("--no-compensation", is_flag=True,
              help="Keep the same channels but only slice (ablation): no closed-form step (corp), no "
                   "mean fold (vbp).")
@click.option("--layer-floor", type=float, default=DEFAULTS["layer_floor"], show_default=True,
              help="vbp: fraction of every MLP's channels always kept.")
@click.option("--token-fraction", type=float, default=DEFAULTS["token_fraction"], show_default=True,
              help="toast: fraction of patch tokens per image sampled for FFN channel importance.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Artifact directory. [default: ./corp-deploy/<model>[-<method>]-s<S>]")
def compress(model, target, calib, calib_samples, model_args, checkpoint, no_pretrained, seed, method, sparsity,
             s_mlp, s_attn, s_vo, macs, speedup, unit_floor, equal_head_dims, batch_size, ranker, ridge, calibration,
             round_to, no_compensation, layer_floor, token_fraction, device, output):
    """Calibrate, rank, compensate and write a compressed-model artifact.

    \b
    Examples:
      corp-deploy compress deit_base --s 0.5
      corp-deploy compress deit_base --macs 0.6                 # best model within 60% of the MACs
      corp-deploy compress deit_base --speedup 2 --round-to 8 --equal-head-dims
      corp-deploy compress deit_base --target all --s 0.3       # MLP, query/key and value dims
      corp-deploy compress deit_base --method vbp --s 0.3
      corp-deploy compress deit_base --method toast --s-mlp 0.5 --s-attn 0.25
      corp-deploy compress deit_tiny --target mlp --s 0.3 --calib ./val_images -o out/tiny
      corp-deploy compress vit_small_patch14_dinov2 --model-arg img_size=224 \\
          --model-arg num_classes=0 --checkpoint dinov2_s.safetensors --s 0.5
    """
    from .artifact import record_latest, save_artifact
    from .calibration import CalibrationImages, model_transform
    from .engine import compress as run_compress, resolve_device
    from .resources import check_fits, compress_bytes
    from .outputs import check_output_dir

    _check_method_options(METHODS[method], s_attn, s_vo)
    if (macs is not None or speedup is not None) and (sparsity, s_mlp, s_attn, s_vo) != (None,) * 4:
        raise click.UsageError("a budget (--macs / --speedup) and sparsities (--s, --s-mlp, --s-attn, --s-vo) "
                               "exclude each other: the budget decides every part's size")
    config = CompressConfig(
        s_mlp=sparsity if s_mlp is None else s_mlp, s_attn=sparsity if s_attn is None else s_attn,
        s_vo=sparsity if s_vo is None else s_vo, macs=macs, speedup=speedup, unit_floor=unit_floor,
        equal_head_dims=equal_head_dims, target=target, ranker=ranker, ridge=ridge, calibration=calibration,
        round_to=round_to, compensation=not no_compensation, device=device, method=method,
        layer_floor=layer_floor, token_fraction=token_fraction)
    out_dir = check_output_dir(output or default_output_dir(model, config), "artifact")
    calib = input_dir(calib, "--calib")
    check_apart([out_dir], {"--calib": calib}, records_state=True)
    resolve_device(device)
    base, base_model = _dense_model(model, model_args, checkpoint, no_pretrained, seed)
    transform, data_config = model_transform(base)
    check_fits(f"compressing {base_model['name']} on {calib_samples} images",
               compress_bytes(base, tuple(data_config["input_size"]), calib_samples, batch_size),
               "use fewer --calib-samples or a smaller --batch-size")
    if calib is None:
        _warn_builtin_calibration()
    images = CalibrationImages.from_source(calib, transform, limit=calib_samples, batch_size=batch_size,
                                           seed=seed)
    compressed, report = run_compress(base, images, config, progress=sys.stderr.isatty())
    summary = images.summary()
    _warn_calibration_shortfall(summary, calib_samples)
    settings = {**config.to_dict(), "calib_samples": calib_samples, "batch_size": batch_size, "seed": seed}
    path = save_artifact(compressed, out_dir, base_model=base_model, settings=settings, calibration=summary,
                         report=report)
    _warn(record_latest(path))
    _print_compress_summary(report, path)


def _warn(message: str | None) -> None:
    if message:
        click.secho(f"warning: {message}", fg="yellow", err=True)


def _warn_calibration_shortfall(summary: dict, requested: int) -> None:
    """Say when calibration skipped unreadable files or used fewer images than asked for."""
    if summary["files_skipped"]:
        reasons = "; ".join(summary["skipped_examples"][:3])
        _warn(f"skipped {summary['files_skipped']} unreadable calibration files ({reasons})")
    if summary["images_used"] < requested:
        _warn(f"calibrated on {summary['images_used']} images, fewer than the {requested} asked for "
              "(--calib-samples): the directory has no more readable images")


def _check_method_options(method, s_attn: float | None, s_vo: float | None) -> None:
    """Refuse options given on the command line that ``method`` would not read (even at their
    default value: a script that names them expects them to matter)."""
    ctx = click.get_current_context()
    for name, owner in option_owners().items():
        if owner != method.name and ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
            raise CorpError(f"--{name.replace('_', '-')} applies to --method {owner} only, not {method.name}")
    for option, value, target in (("--s-attn", s_attn, "attn"), ("--s-vo", s_vo, "vo")):
        if value is not None and target not in method.targets:
            others = [m.name for m in METHODS.values() if target in m.targets]
            raise CorpError(f"--method {method.name} prunes {method.prunes} only; {option} has no meaning for it "
                            f"(use --method {' or '.join(others)})")


def _warn_builtin_calibration() -> None:
    _warn("no --calib given; calibrating on built-in photos. Images from your deployment distribution give "
          "better accuracy.")


def _print_compress_summary(report: dict, path: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    layers = report["layers"]
    table = Table(title=f"corp-deploy compress ({report['method']}) -> {path}")
    table.add_column("")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    p, m = report["params"], report["macs"]
    table.add_row("parameters (M)", f"{p['dense'] / 1e6:.2f}", f"{p['compressed'] / 1e6:.2f}")
    table.add_row("GMACs / image", f"{m['dense'] / 1e9:.2f}", f"{m['compressed'] / 1e9:.2f}")
    for part, label in (("mlp", "MLP output"), ("attention", "attention logits"), ("values", "value/output")):
        rows = [layer[part] for layer in layers if "relative_error_compensated" in layer.get(part, {})]
        if rows:
            unc = sum(r["relative_error_uncompensated"] for r in rows) / len(rows)
            comp = sum(r["relative_error_compensated"] for r in rows) / len(rows)
            table.add_row(f"{label} rel. error (sliced, compensated)", f"{unc:.4f}", f"{comp:.4f}")
    table.add_row("compress wall time (s)", "", f"{report['time_s']['total']:.1f}")
    console = Console()
    console.print(table)
    if "budget" in report:
        console.print(_allocation_table(report["budget"]))


def _allocation_table(budget: dict):
    """Per block: the kept dims of every unit (of its full size) and its distortion."""
    from rich.table import Table

    from .plots import PART_LABELS

    parts = list(dict.fromkeys(u["part"] for u in budget["units"]))
    table = Table(title=f"budget {budget['macs_fraction']:.3g} of the dense MACs: "
                        f"{budget['planned_macs'] / 1e9:.3f} of {budget['dense_macs'] / 1e9:.3f} GMACs",
                  caption=f"kept / full (distortion, {budget['distortion']})")
    table.add_column("block", justify="right")
    for part in parts:
        table.add_column(PART_LABELS[part], justify="right")
    by_key = {(u["block"], u["part"]): u for u in budget["units"]}
    for block in sorted({u["block"] for u in budget["units"]}):
        table.add_row(str(block), *[f"{u['kept']}/{u['total']} ({u['distortion']:.2g})"
                                    for u in (by_key[block, part] for part in parts)])
    return table



@cli.command()
@click.argument("artifact", required=False, type=click.Path(path_type=Path))
@click.option("--trt", is_flag=True, help="Also build TensorRT engines (needs TensorRT and a CUDA GPU; "
                                           "build_engine.sh is written either way).")
@click.option("--dense", is_flag=True, help="Also export the unpruned base model (dense.onnx) the same way.")
@click.option("--opset", type=int, default=DEFAULT_OPSET, show_default=True, help="ONNX opset.")
@click.option("--exporter", type=click.Choice(EXPORTERS), default=DEFAULT_EXPORTER, show_default=True,
              help="torch.onnx exporter.")
@click.option("--batch", "batch", default=str(BatchProfile()), show_default=True, metavar="MIN:OPT:MAX",
              help="TensorRT optimisation profile of the batch axis (the ONNX batch axis is dynamic).")
@click.option("--precision", type=click.Choice(EXPORT_PRECISIONS), default="fp32", show_default=True,
              help="Precision written into the graph; LayerNorm, softmax and the patch embedding stay fp32 "
                   "(int8: a QDQ graph, Linear layers in int8).")
@click.option("--int8-calibration", type=click.Choice(tuple(CALIBRATION_METHODS)), default=DEFAULT_CALIBRATION,
              show_default=True, help="int8: how activation ranges are set from the calibration images.")
@click.option("--int8-keep-float", default="auto", show_default=True, metavar="auto|N", callback=_keep_float_count,
              help="int8: keep N Linear layers in float, those whose int8 rounding errs most; auto: the fewest "
                   "(0, 1, 2, 4, ... up to a quarter) that meet the gate's tolerance on the calibration images, a "
                   "quarter of them held back from the ranges.")
@click.option("--calib", type=click.Path(path_type=Path), default=None,
              help="int8: calibration image directory. [default: what compress used, from config.json]")
@click.option("--calib-samples", type=IMAGE_COUNT, default=None,
              help="int8: number of calibration images. [default: as many as compress used]")
@click.option("--workspace", "workspace_gb", type=float, default=None, metavar="GB",
              help="TensorRT builder workspace limit. [default: TensorRT's]")
@click.option("--timing-cache", type=click.Path(path_type=Path), default=None,
              help="TensorRT timing cache: read if it exists, updated after the build.")
@click.option("--atol", type=float, default=None,
              help="Parity gate: max abs error vs the reference. [default: 1e-4 for fp32, not checked "
                   "for fp16/bf16]")
@click.option("--min-cosine", type=float, default=None,
              help="Parity gate: smallest per-image cosine. [default: 0.99999 fp32, 0.999 fp16, 0.99 bf16, "
                   "0.98 int8]")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Export directory. [default: ARTIFACT/export-<precision>]")
def export(artifact, trt, dense, opset, exporter, batch, precision, int8_calibration, int8_keep_float, calib,
           calib_samples, workspace_gb, timing_cache, atol, min_cosine, output):
    """Export a compressed artifact to ONNX (and TensorRT), with parity gates.

    Every ONNX file is checked against the PyTorch model on calibration-like images at batch
    sizes 1 and 8, every TensorRT engine against ONNX Runtime; a failed gate writes nothing.
    Without ARTIFACT, the most recent one written by `compress` is used.

    \b
    Exit status: 0 done; 1 error; 2 bad usage; 3 files written but not finished here (no
    TensorRT or no CUDA GPU for the engines, or a bf16 graph nothing here can check: finish on
    the target, e.g. with build_engine.sh); 4 parity gate failed (nothing written).

    \b
    Examples:
      corp-deploy export --trt
      corp-deploy export corp-deploy/deit_base-s0.5 --dense --precision fp16 -o out/deit_base-fp16
      corp-deploy export corp-deploy/deit_base-s0.5 --dense --precision int8 --calib ./images
      corp-deploy export --trt --batch 1:16:64 --workspace 4 --timing-cache ~/.cache/trt.cache
    """
    from exporters.parity import Tolerance
    from exporters.pipeline import EXIT_INCOMPLETE, ExportOptions, default_export_dir, export_artifact
    from exporters.tensorrt import INSTALL_HINT, SCRIPT_NAME

    from .artifact import latest_artifact
    from .outputs import resolve

    if artifact is None:
        artifact = latest_artifact()
        click.echo(f"exporting the most recent artifact: {artifact}", err=True)
    options = ExportOptions(
        trt=trt, dense=dense, opset=opset, exporter=exporter,
        precision=precision, batch=BatchProfile.parse(batch), workspace_gb=workspace_gb,
        timing_cache=timing_cache, int8_calibration=int8_calibration, int8_keep_float=int8_keep_float, calib=calib,
        calib_samples=calib_samples,
        tolerance=Tolerance.for_precision(precision, atol=atol, min_cosine=min_cosine))
    check_apart([resolve(output or default_export_dir(artifact, precision))], {"--calib": options.calib})
    result = export_artifact(artifact, output, options, log=lambda message: click.echo(message, err=True))
    _print_export_summary(result)
    if result.incomplete:
        for reason in result.incomplete:
            click.secho(f"not done here: {reason}", fg="yellow", err=True)
        if trt and not result.manifest["tensorrt"]["built"]:
            click.echo(f"To build the engines on the target GPU machine, either run\n"
                       f"  {INSTALL_HINT} && corp-deploy export {artifact} --trt ...   (builds and checks)\n"
                       f"or, with TensorRT's trtexec there,\n"
                       f"  bash {result.out_dir / SCRIPT_NAME}", err=True)
        sys.exit(EXIT_INCOMPLETE)


def _print_export_summary(result) -> None:
    """The parity checks of an :class:`exporters.results.ExportResult`, one row per checked file."""
    from rich.console import Console
    from rich.table import Table

    manifest = result.manifest
    table = Table(title=f"corp-deploy export -> {result.out_dir}",
                  caption=f"{manifest['precision']}, {manifest['exporter']} exporter, opset {manifest['opset']}")
    for column in ("file", "checked against", "max abs err", "min cosine", "top-1 agree"):
        table.add_column(column, justify="left" if column in ("file", "checked against") else "right")
    for entry in result.models.values():
        for check in entry.parity:
            if check.skipped is not None:
                table.add_row(check.file, check.reference, "not run", "", "")
                continue
            worst = check.worst()
            table.add_row(check.file, check.reference, f"{worst.max_abs:.2e}", f"{worst.cosine:.6f}",
                          f"{worst.top1_agreement:.3f}" if worst.top1_agreement is not None else "-")
    Console().print(table)


def _parse_sizes(text: str, option: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise CorpError(f"{option} takes comma-separated positive integers (e.g. 1,8,32); got {text!r}")
    return sizes


@cli.command()
@click.argument("target", required=False, type=click.Path(path_type=Path))
@click.option("--backends", default="torch,ort,trt", show_default=True,
              help="Backend families: torch (CPU, CUDA), ort (CPU, CUDA and TensorRT providers), trt (engines).")
@click.option("--batch", "batches", default="1,8,32", show_default=True, help="Batch sizes to time.")
@click.option("--threads", type=THREADS, default=None,
              help="CPU threads for PyTorch and ONNX Runtime. [default: PyTorch's]")
@click.option("--warmup", type=click.IntRange(0, 10_000), default=3, show_default=True,
              help="Untimed rounds before timing.")
@click.option("--min-time", type=SECONDS, default=2.0, show_default=True,
              help="Seconds each model is timed per backend and batch size (at least 5 rounds).")
@click.option("--data", type=click.Path(path_type=Path), default=None,
              help="Held-out images for fidelity (kept out of calibration); a class_index.json makes it "
                   "labelled (ImageFolder layout, see README). [default: 5 bundled photos kept out of "
                   "calibration]")
@click.option("--data-samples", type=IMAGE_COUNT, default=256, show_default=True,
              help="At most this many evaluation images.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None, help="Write the full report.")
@click.option("--markdown", "markdown_path", type=click.Path(path_type=Path), default=None, help="Write tables.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), default=None, help="Write a PNG plot.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Write bench.json, bench.md and bench.png into this directory.")
@click.option("--baseline", type=click.Path(path_type=Path), default=None,
              help="A previous --json report: fail when latency, speedup or fidelity regress.")
@click.option("--max-regression", type=float, default=0.05, show_default=True,
              help="Allowed relative regression against --baseline.")
@click.option("--min-agreement", type=float, default=None, help="Fail below this top-1 agreement with dense.")
@click.option("--max-kl", type=float, default=None, help="Fail above this mean KL divergence from dense.")
@click.option("--min-cosine", type=float, default=None, help="Fail below this mean feature cosine to dense.")
@click.option("--min-parity-cosine", type=float, default=0.999, show_default=True,
              help="Fail when any backend's output cosine to PyTorch (CPU) is below this.")
def bench(target, backends, batches, threads, warmup, min_time, data, data_samples, json_path, markdown_path,
          plot_path, output, baseline, max_regression, min_agreement, max_kl, min_cosine, min_parity_cosine):
    """Latency, parity and fidelity of a compressed model against its dense base.

    TARGET is an artifact (its export-fp32/ export is used when present) or an export
    directory; without it, the most recent artifact. Dense and compressed runs are
    interleaved on every available backend; unavailable backends are listed with the reason.
    When the artifact also has an export-int8/ (both exports made with --dense), the dense and
    compressed fp32 and int8 graphs are timed together on ONNX Runtime's CPU provider and their
    fidelity against dense fp32 is measured.

    \b
    Exit status: 0 passed; 1 error; 2 bad usage; 4 the regression gate failed (the reports
    are still written).

    \b
    Examples:
      corp-deploy bench --backends ort --batch 1,32 -o bench/
      corp-deploy bench corp-deploy/deit_base-s0.5 --data val/ --json new.json --baseline main.json
    """
    from benchmarks.backends import parse_families
    from benchmarks.data import check_labels, eval_images
    from benchmarks.gate import GateLimits, read_report, regressions
    from benchmarks.harness import BenchSettings, run_bench
    from benchmarks.int8 import Int8Graphs, int8_graphs, run_int8_bench
    from benchmarks.report import check_report_file, print_terminal, write_outputs
    from benchmarks.targets import calibration_overlap, load_models, resolve_target

    from .calibration import model_transform
    from .resources import check_fits, inference_bytes
    from .outputs import check_output_dir

    settings = BenchSettings(backends=parse_families(backends), batches=_parse_sizes(batches, "--batch"),
                             threads=threads, warmup=warmup, min_time=min_time)
    parity_requested = (click.get_current_context().get_parameter_source("min_parity_cosine")
                        == click.core.ParameterSource.COMMANDLINE)
    limits = GateLimits(max_regression=max_regression, min_agreement=min_agreement, max_kl=max_kl,
                        min_cosine=min_cosine, min_parity_cosine=min_parity_cosine, parity_requested=parity_requested)
    files = {rendering: check_report_file(path, rendering) for rendering, path in
             (("json", json_path), ("markdown", markdown_path), ("plot", plot_path)) if path is not None}
    folder = check_output_dir(output, "bench") if output is not None else None
    inside = [path for path in files.values() if folder is not None and folder in path.parents]
    if inside:
        raise CorpError(f"{inside[0]} lies inside -o {output}; write it there without --json/--markdown/--plot, "
                        "or elsewhere")
    if len(set(files.values())) < len(files):
        raise CorpError("--json, --markdown and --plot must name different files")
    data = input_dir(data, "--data")
    check_apart([*files.values(), *([folder] if folder else [])], {"--data": data})
    previous = read_report(baseline) if baseline is not None else None
    artifact, export_dir = resolve_target(target)
    click.echo(f"benchmarking {artifact}" + (f" with the export {export_dir}" if export_dir else
                                             " (no export found: ONNX Runtime and TensorRT need one)"), err=True)
    compressed, dense = load_models(artifact, export_dir)
    transform, data_config = model_transform(compressed.torch)
    check_fits(f"timing at batch {max(settings.batches)}",
               inference_bytes(dense.torch, tuple(data_config["input_size"]), max(settings.batches)),
               "use smaller --batch sizes")
    evaluation = eval_images(data, transform, limit=data_samples)
    check_labels(evaluation, compressed.torch.num_classes)
    held_out = not calibration_overlap(artifact, evaluation.description)
    if not held_out:
        _warn("the evaluation images overlap the calibration images; fidelity is not held out")

    def log(message: str) -> None:
        click.echo(message, err=True)

    report = run_bench(compressed, dense, evaluation, settings, held_out=held_out, log=log)
    skipped = report["fidelity"]["data"].get("files_skipped")
    if skipped:
        _warn(f"skipped {skipped} unreadable evaluation files ({'; '.join(report['fidelity']['data']['skipped_examples'][:3])})")
    int8 = int8_graphs(artifact) if "ort" in settings.backends else Int8Graphs()
    if int8.skipped is not None:
        report["int8"] = {"skipped": int8.skipped}
    elif int8.graphs:
        report["int8"] = run_int8_bench(int8.graphs, dense.torch, evaluation, settings, log)
    found = regressions(report, limits, previous)
    report["gate"] = {"baseline": str(baseline) if baseline else None, "limits": limits.to_dict(),
                      "passed": not found, "regressions": found}
    written = write_outputs(report, files, folder)
    print_terminal(report)
    for path in written:
        click.echo(f"wrote {path}", err=True)
    if found:
        click.secho("regression gate FAILED:", fg="red", err=True)
        for item in found:
            click.echo(f"  {item}", err=True)
        sys.exit(4)


def _parse_values(text: str, option: str, example: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values:
        raise CorpError(f"{option} takes comma-separated numbers (e.g. {example}); got {text!r}")
    return values


@cli.command()
@_model_source_options
@click.option("--s", "sparsities", default=None,
              help="Comma-separated sparsities (applied to the parts chosen by --target). [default: "
                   "0.1,0.3,0.5,0.7 without --macs]")
@click.option("--macs", "budgets", default=None,
              help="Comma-separated MAC budgets (fractions of the dense MACs, e.g. 0.8,0.6,0.4) instead of "
                   "sparsities; methods corp and uncompensated.")
@click.option("--methods", default="corp", show_default=True,
              help="Comma-separated: corp, vbp, toast, uncompensated (CORP's channels, only sliced). The "
                   "first is the reference for the matched-MACs table.")
@click.option("--data", type=click.Path(path_type=Path), default=None,
              help="Held-out evaluation images (see `bench --help`). [default: bundled photos kept out "
                   "of calibration]")
@click.option("--data-samples", type=IMAGE_COUNT, default=256, show_default=True)
@click.option("--backends", default="torch,ort,trt", show_default=True, help="As for bench.")
@click.option("--batch", "batches", default="1,8,32", show_default=True, help="Batch sizes to time.")
@click.option("--threads", type=THREADS, default=None, help="As for bench.")
@click.option("--min-time", type=SECONDS, default=2.0, show_default=True,
              help="As for bench.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Sweep directory. [default: ./corp-deploy/sweep-<model>[-<target>]]")
def sweep(model, target, calib, calib_samples, model_args, checkpoint, no_pretrained, seed, sparsities, budgets,
          methods, data, data_samples, backends, batches, threads, min_time, output):
    """Compress with each method at several sparsities (or MAC budgets), export, benchmark, and compare.

    Writes one artifact (with its ONNX export) per method and point, sweep.json (every
    number), sweep.md (every run, then fidelity at matched sparsity or budget and at matched
    MACs) and sweep.png (fidelity vs sparsity or budget, fidelity vs MACs, speedup). Without
    --target each method prunes what it prunes by default (vbp: the MLP only; corp with
    budgets: MLP, query/key and value dims).

    \b
    Examples:
      corp-deploy sweep deit_small --s 0.3,0.5,0.7 --methods corp,uncompensated --calib train/ --data val/
      corp-deploy sweep deit_base --no-pretrained --s 0.3,0.5,0.7 --backends ort --batch 1,32
      corp-deploy sweep deit_small --methods corp,vbp,toast,uncompensated --s 0.2,0.4,0.6 --backends ort
      corp-deploy sweep deit_small --macs 0.8,0.6,0.4 --backends ort --batch 1,32
    """
    from benchmarks.backends import parse_families
    from benchmarks.harness import BenchSettings
    from benchmarks.sweep import SweepSpec, run_sweep

    from .outputs import check_output_dir

    if sparsities is not None and budgets is not None:
        raise click.UsageError("--s and --macs exclude each other: a sweep runs sparsities or budgets")
    try:
        spec = SweepSpec(
            sparsities=() if budgets else _parse_values(sparsities or "0.1,0.3,0.5,0.7", "--s", "0.1,0.3,0.5"),
            budgets=_parse_values(budgets, "--macs", "0.8,0.6,0.4") if budgets else (), target=target,
            methods=tuple(m.strip() for m in methods.split(",") if m.strip()),
            calib=input_dir(calib, "--calib"), calib_samples=calib_samples,
            data=input_dir(data, "--data"), data_samples=data_samples, seed=seed,
            bench=BenchSettings(backends=parse_families(backends), batches=_parse_sizes(batches, "--batch"),
                                threads=threads, min_time=min_time))
    except SettingError as exc:  # a sweep sets every sparsity with --s
        raise CorpError(exc.naming(lambda setting: "--s" if setting.startswith("s_") else option_name(setting)))
    out_dir = check_output_dir(output or DEFAULT_OUTPUT_ROOT / f"sweep-{model.replace('/', '_')}"
                                         f"{f'-{target}' if target else ''}", "sweep")
    check_apart([out_dir], {"--calib": spec.calib, "--data": spec.data})
    dense, base_model = _dense_model(model, model_args, checkpoint, no_pretrained, seed)
    if calib is None:
        _warn_builtin_calibration()
    run_sweep(dense, base_model, spec, out_dir, log=lambda message: click.echo(message, err=True))
    click.echo((out_dir / "sweep.md").read_text())
    click.echo(f"wrote {out_dir}/ (sweep.json, sweep.md, sweep.png and one artifact per run)", err=True)
