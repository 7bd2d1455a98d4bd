"""``corp-deploy bench``: latency, parity and fidelity against the dense model, and the gate."""

from __future__ import annotations

import sys

import click

from benchmarks.gate import BASELINE_GATES

from ..errors import EXIT_GATE_FAILED, BadUsage
from .common import (
    check_output_paths,
    check_torch_options_apply,
    given_on_command_line,
    input_dir,
    results_output,
    warn,
)
from .group import cli
from .options import PATH, CommaList, evaluation_options, timing_options

#: What configures the comparison with --baseline, by parameter: refused without it.
_BASELINE_OPTIONS = {
    "gates": "--gate",
    "max_regression": "--max-regression",
    "max_latency_regression": "--max-latency-regression",
}


@cli.command()
@click.argument("target", required=False, type=PATH)
@timing_options
@click.option(
    "--warmup", type=click.IntRange(0, 10_000), default=3, show_default=True, help="Untimed rounds before timing."
)
@evaluation_options
@click.option("--json", "json_path", type=PATH, default=None, help="Write the full report.")
@click.option("--markdown", "markdown_path", type=PATH, default=None, help="Write tables.")
@click.option("--plot", "plot_path", type=PATH, default=None, help="Write a PNG plot.")
@click.option(
    "-o",
    "--output",
    type=PATH,
    default=None,
    help="Write bench.json, bench.md and bench.png into this directory (a report named by --json, "
    "--markdown or --plot goes to that file instead).",
)
@click.option(
    "--baseline",
    type=PATH,
    default=None,
    help="A previous --json report: fail when what --gate names regresses.",
)
@click.option(
    "--gate",
    "gates",
    type=CommaList(str, "gate names", "speedup,fidelity"),
    default=",".join(BASELINE_GATES),
    show_default=True,
    metavar="NAMES",
    help="What --baseline gates, comma-separated: latency (absolute: it moves with the machine's load, "
    "so only on a dedicated runner), speedup (timed interleaved with the dense model: holds on a shared "
    "runner), fidelity, int8.",
)
@click.option(
    "--max-regression",
    type=float,
    default=0.05,
    show_default=True,
    help="Allowed relative regression against --baseline (of latency too, unless --max-latency-regression).",
)
@click.option(
    "--max-latency-regression",
    type=float,
    default=None,
    help="Allowed relative growth of the compressed model's p50 latency against --baseline "
    "[default: --max-regression].",
)
@click.option("--min-agreement", type=float, default=None, help="Fail below this top-1 agreement with dense.")
@click.option("--max-kl", type=float, default=None, help="Fail above this mean KL divergence from dense.")
@click.option("--min-cosine", type=float, default=None, help="Fail below this mean feature cosine to dense.")
@click.option(
    "--min-parity-cosine",
    type=float,
    default=0.999,
    show_default=True,
    help="Fail when any backend's output cosine to PyTorch (CPU) is below this.",
)
def bench(
    target,
    backends,
    batches,
    threads,
    warmup,
    min_time,
    torch_precision,
    timing,
    cuda_graphs,
    data,
    data_samples,
    json_path,
    markdown_path,
    plot_path,
    output,
    baseline,
    gates,
    max_regression,
    max_latency_regression,
    min_agreement,
    max_kl,
    min_cosine,
    min_parity_cosine,
):
    """Latency, parity and fidelity of a compressed model against its dense base.

    TARGET is an artifact (its export-fp32/ export is used when present) or an export
    directory; without it, the most recent artifact. Dense and compressed runs are
    interleaved on every available backend; unavailable backends are listed with the reason.
    When the artifact also has an export-int8/ (both exports made with --dense), the dense and
    compressed fp32 and int8 graphs are timed together on ONNX Runtime's CPU provider and their
    fidelity against dense fp32 is measured.

    \b
    Exit status: 0 passed; 1 error; 2 bad usage; 4 the regression gate failed (the reports
    are still written); 5 the reports are written but a step after them failed; 128 + N stopped by
    signal N (130 Ctrl-C, 143 SIGTERM; `corp-deploy --help` lists every status).

    \b
    On a shared CI runner, gate what load slows alike: --gate speedup,fidelity (absolute latency
    moves with the other jobs on the machine).

    \b
    Examples:
      corp-deploy bench --backends ort --batch 1,32 -o bench/
      corp-deploy bench corp-deploy/deit_base-s0.5 --data val/ --json new.json --baseline main.json
      corp-deploy bench ART --baseline main.json --gate speedup,fidelity --max-regression 0.1
    """
    from benchmarks.gate import GateLimits
    from benchmarks.pipeline import bench_target
    from benchmarks.report import check_report_outputs, print_terminal, write_outputs
    from benchmarks.results import BenchSettings

    settings = BenchSettings(
        backends=backends,
        batches=batches,
        threads=threads,
        warmup=warmup,
        min_time=min_time,
        torch_precision=torch_precision,
        timing=timing,
        cuda_graphs=cuda_graphs,
    )
    limits = GateLimits(
        max_regression=max_regression,
        max_latency_regression=max_latency_regression,
        gates=gates,
        gates_requested=given_on_command_line("gates"),
        min_agreement=min_agreement,
        max_kl=max_kl,
        min_cosine=min_cosine,
        min_parity_cosine=min_parity_cosine,
        parity_requested=given_on_command_line("min_parity_cosine"),
    )
    check_torch_options_apply(settings.backends)
    _check_baseline_options_apply(baseline)
    files, folder = check_report_outputs(
        {"json": json_path, "markdown": markdown_path, "plot": plot_path}, output, baseline
    )
    data = input_dir(data, "--data")
    check_output_paths([*files.values(), *([folder] if folder else [])], {"--data": data})
    report = bench_target(
        target,
        settings,
        limits,
        data=data,
        data_samples=data_samples,
        baseline=baseline,
        log=lambda message: click.echo(message, err=True),
        warn=warn,
    )
    written = write_outputs(report, files, folder)
    with results_output() as console:
        print_terminal(report, console)
    for path in written:
        click.echo(f"wrote {path}", err=True)
    _say_the_gate(report, limits, baseline)
    if not report.gate.passed:
        sys.exit(EXIT_GATE_FAILED)


def _check_baseline_options_apply(baseline) -> None:
    """BadUsage when what configures the comparison with ``--baseline`` is given without it, even at
    its default values: a script that names them expects a gate."""
    named = [option for parameter, option in _BASELINE_OPTIONS.items() if given_on_command_line(parameter)]
    if named and baseline is None:
        raise BadUsage(f"{', '.join(named)} {'applies' if len(named) == 1 else 'apply'} only with --baseline")


def _say_the_gate(report, limits, baseline) -> None:
    """The regression gate's verdict on stderr: where it passed and was asked for, what held (a CI
    log says so: against which baseline, which gates were compared); where it failed, every regression."""
    from benchmarks.gate import compared_gates, read_baseline

    if report.gate.passed and (baseline is not None or limits.requested):
        against = ""
        if baseline is not None:  # the gates compared: those the baseline has numbers of
            compared = compared_gates(read_baseline(baseline), limits)
            unmeasured = [gate for gate in limits.gates if gate not in compared]
            against = f" against {baseline} (compared: {','.join(compared)}" + (
                f"; not in the baseline: {','.join(unmeasured)})" if unmeasured else ")"
            )
        click.secho(f"regression gate passed{against}", fg="green", err=True)
    if not report.gate.passed:
        click.secho("regression gate FAILED:", fg="red", err=True)
        for item in report.gate.regressions:
            click.echo(f"  {item}", err=True)
