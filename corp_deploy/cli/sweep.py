"""``corp-deploy sweep``: compress, export and bench over a grid of sparsities or budgets."""

from __future__ import annotations

from datetime import timedelta

import click

from ..config import CompressConfig
from .common import (
    DEFAULT_OUTPUT_ROOT,
    check_output_paths,
    check_recovery_options_apply,
    check_torch_options_apply,
    dense_model,
    input_dir,
    nothing_pruned_warning,
    results_output,
    warn,
    warn_builtin_calibration,
)
from .group import cli
from .options import PATH, CommaList, evaluation_options, model_source_options, recovery_options, timing_options

#: The sparsities of a sweep given neither --s nor --macs.
DEFAULT_SPARSITIES = (0.1, 0.3, 0.5, 0.7)
#: Under torchrun, how long the other processes wait while the first exports and times one point.
FIRST_RANK_WAIT = timedelta(hours=24)


@cli.command()
@model_source_options
@click.option(
    "--s",
    "sparsities",
    type=CommaList(float, "numbers", "0.1,0.3,0.5", "NUMBERS"),
    default=None,
    help="Comma-separated sparsities (applied to the parts chosen by --target). [default: "
    "0.1,0.3,0.5,0.7 without --macs]",
)
@click.option(
    "--macs",
    "budgets",
    type=CommaList(float, "numbers", "0.8,0.6,0.4", "NUMBERS"),
    default=None,
    help="Comma-separated MAC budgets (fractions of the dense MACs, e.g. 0.8,0.6,0.4) instead of "
    "sparsities; methods corp and uncompensated.",
)
@click.option(
    "--methods",
    type=CommaList(str, "method names", "corp,vbp"),
    default=CompressConfig.method,
    show_default=True,
    help="Comma-separated: corp, vbp, toast, uncompensated (CORP's channels, only sliced). The "
    "first is the reference for the matched-MACs table.",
)
@evaluation_options
@timing_options
@recovery_options
@click.option(
    "-o",
    "--output",
    type=PATH,
    default=None,
    help="Sweep directory. [default: ./corp-deploy/sweep-<model>[-<target>]]",
)
def sweep(
    model,
    target,
    calib,
    calib_samples,
    calib_crops,
    model_args,
    checkpoint,
    no_pretrained,
    seed,
    sparsities,
    budgets,
    methods,
    data,
    data_samples,
    backends,
    batches,
    threads,
    min_time,
    torch_precision,
    timing,
    cuda_graphs,
    output,
    **recovery_settings,
):
    """Compress with each method at several sparsities (or MAC budgets), export, benchmark, and compare.

    Writes one artifact (with its ONNX export) per method and point, sweep.json (every
    number), sweep.md (every run, then fidelity at matched sparsity or budget and at matched
    MACs) and sweep.png (fidelity vs sparsity or budget, fidelity vs MACs, speedup). Without
    --target each method prunes what it prunes by default (vbp: the MLP only; corp with
    budgets: MLP, query/key and value dims). Under torchrun (corp and uncompensated) each
    point is calibrated on every process's share of the images; the first process exports
    and times it, alone. With --recover-steps N every method's points also run recovered
    (compressed again, then recovered), as the method <method>+rec<N> beside it.

    \b
    Examples:
      corp-deploy sweep deit_small --s 0.3,0.5,0.7 --methods corp,uncompensated --calib train/ --data val/
      corp-deploy sweep deit_base --no-pretrained --s 0.3,0.5,0.7 --backends ort --batch 1,32
      corp-deploy sweep deit_small --methods corp,vbp,toast,uncompensated --s 0.2,0.4,0.6 --backends ort
      corp-deploy sweep deit_small --macs 0.8,0.6,0.4 --backends ort --batch 1,32
      corp-deploy sweep deit_small --s 0.3,0.5 --recover-steps 100 --calib train/ --data val/
      torchrun --nproc-per-node 4 --no-python -- corp-deploy sweep deit_base --s 0.3,0.5 -o sweep-deit
    """
    from benchmarks.results import BenchSettings
    from benchmarks.sweep import SweepSpec, run_sweep

    from .. import distributed
    from ..outputs import check_output_dir
    from ..recovery import RecoveryConfig

    if sparsities is not None and budgets is not None:
        raise click.UsageError("--s and --macs exclude each other: a sweep runs sparsities or budgets")
    spec = SweepSpec(
        sparsities=() if budgets is not None else sparsities or DEFAULT_SPARSITIES,
        budgets=budgets or (),
        target=target,
        methods=methods,
        calib=input_dir(calib, "--calib"),
        calib_samples=calib_samples,
        calib_crops=calib_crops,
        data=input_dir(data, "--data"),
        data_samples=data_samples,
        seed=seed,
        bench=BenchSettings(
            backends=backends,
            batches=batches,
            threads=threads,
            min_time=min_time,
            torch_precision=torch_precision,
            timing=timing,
            cuda_graphs=cuda_graphs,
        ),
        recovery=RecoveryConfig.from_settings({**recovery_settings, "recover_seed": seed}),  # as compress --seed
    )
    check_recovery_options_apply(spec.recovery.steps)
    check_torch_options_apply(spec.bench.backends)
    out_dir = check_output_dir(
        output or DEFAULT_OUTPUT_ROOT / f"sweep-{model.replace('/', '_')}{f'-{target}' if target else ''}", "sweep"
    )
    check_output_paths([out_dir], {"--calib": spec.calib, "--data": spec.data})
    distributed.init_from_environment("cpu", timeout=FIRST_RANK_WAIT)
    try:
        first = distributed.rank() == 0
        dense, base_model = dense_model(model, model_args, checkpoint, no_pretrained, seed)
        if calib is None and first:
            warn_builtin_calibration()
        result = run_sweep(
            dense,
            base_model,
            spec,
            out_dir,
            log=lambda message: click.echo(message, err=True) if first else None,
            warn=warn,
        )
    finally:
        distributed.shutdown()
    if result is not None:
        for row in result.rows:  # a point that pruned nothing (--s 0, --macs 1) is the dense model
            message = nothing_pruned_warning(row.macs.dense, row.macs.compressed, row.budget)
            if message:
                warn(f"{row.artifact}: {message}")
        with results_output():
            click.echo((out_dir / "sweep.md").read_text())
        click.echo(f"wrote {out_dir}/ (sweep.json, sweep.md, sweep.png and one artifact per run)", err=True)
