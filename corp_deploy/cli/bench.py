"""``corp-deploy bench``: latency, parity and fidelity against the dense model, and the gate."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from ..errors import CorpError
from .common import check_apart, input_dir, warn
from .group import cli
from .options import evaluation_options, parse_sizes, timing_options


@cli.command()
@click.argument("target", required=False, type=click.Path(path_type=Path))
@timing_options
@click.option("--warmup", type=click.IntRange(0, 10_000), default=3, show_default=True,
              help="Untimed rounds before timing.")
@evaluation_options
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

    from ..calibration import model_transform
    from ..outputs import check_output_dir
    from ..resources import check_fits, inference_bytes

    settings = BenchSettings(backends=parse_families(backends), batches=parse_sizes(batches, "--batch"),
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
        warn("the evaluation images overlap the calibration images; fidelity is not held out")

    def log(message: str) -> None:
        click.echo(message, err=True)

    report = run_bench(compressed, dense, evaluation, settings, held_out=held_out, log=log)
    skipped = report["fidelity"]["data"].get("files_skipped")
    if skipped:
        warn(f"skipped {skipped} unreadable evaluation files ({'; '.join(report['fidelity']['data']['skipped_examples'][:3])})")
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
