"""Rendering a bench report: Markdown, a PNG plot, and the terminal table."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from corp_deploy import CorpError
from corp_deploy.errors import BadUsage
from corp_deploy.files import atomic_files, json_text
from corp_deploy.outputs import (
    check_creatable,
    check_output_dir,
    enclosing_output,
    mark_complete,
    note_planned,
    resolve,
    staged_output,
)

from .backends import ON_THE_CPU, TORCH_FAMILIES
from .results import BENCH_FORMAT, BenchReport, Int8Result

if TYPE_CHECKING:
    from rich.console import Console

#: How a bench Markdown report begins (a later run replaces a file that begins so, and no other).
MARKDOWN_TITLE = "<!-- written by corp-deploy bench; its next run may replace this file -->\n# corp-deploy bench"


def _fmt(value, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def _spread(ratio, spec: str = ".3f") -> str:
    """A ratio's median with its 10th-90th percentile spread: ``1.234 (1.100-1.300)``."""
    return f"{ratio.median:{spec}} ({ratio.p10:{spec}}-{ratio.p90:{spec}})"


def latency_rows(report: BenchReport) -> list[list[str]]:
    """One row per backend and batch size: how it was timed, latencies, throughputs, speedup with its
    spread."""
    return [
        [
            r.backend,
            str(r.batch),
            r.timing,
            f"{r.dense.p50_s * 1e3:.2f}",
            f"{r.compressed.p50_s * 1e3:.2f}",
            f"{r.compressed.p90_s * 1e3:.2f} / {r.compressed.p99_s * 1e3:.2f}",
            f"{r.dense.throughput_ips:.1f}",
            f"{r.compressed.throughput_ips:.1f}",
            _spread(r.speedup),
            f"{r.ideal_speedup:.3f}",
            f"{r.efficiency * 100:.1f}%",
        ]
        for r in report.latency
    ]


LATENCY_HEADER = [
    "backend",
    "batch",
    "timing",
    "dense p50 (ms)",
    "compressed p50 (ms)",
    "compressed p90 / p99 (ms)",
    "dense img/s",
    "compressed img/s",
    "speedup (p10-p90)",
    "MAC-ideal",
    "of ideal",
]


def fidelity_summary(report: BenchReport) -> str:
    f = report.fidelity
    text = (
        f"{f.images} images ({f.data['source']}{', held out' if f.held_out else ', NOT held out'}): "
        f"top-1 agreement {_fmt(f.top1_agreement)}, mean KL {_fmt(f.kl_mean, '.4g')}, "
        f"feature cosine {_fmt(f.feature_cosine)}"
    )
    if f.accuracy:
        dense, compressed = f.accuracy["dense"], f.accuracy["compressed"]
        text += (
            f"; accuracy top-1/top-5: dense {dense.top1:.4f}/{dense.top5:.4f}, "
            f"compressed {compressed.top1:.4f}/{compressed.top5:.4f}"
        )
    return text


def to_markdown(report: BenchReport) -> str:
    m, machine = report.models, report.machine
    lines = [
        MARKDOWN_TITLE,
        "",
        f"{report.created} on {machine.cpu} ({machine.cpu_count} CPUs, {machine.torch_threads} "
        f"threads{', GPU ' + machine.gpu if machine.gpu else ''}).",
        "",
        "| model | params (M) | GMACs / image |",
        "|---|---|---|",
        *[f"| {name} | {m[name].params / 1e6:.2f} | {m[name].macs / 1e9:.4g} |" for name in ("dense", "compressed")],
        "",
        f"MAC-ideal speedup: {report.ideal_speedup:.3f}x.",
        "",
        f"## Latency (dense and compressed timed interleaved{_torch_precision(report, '; PyTorch in ')})",
        "",
        "| " + " | ".join(LATENCY_HEADER) + " |",
        "|" + "---|" * len(LATENCY_HEADER),
        *["| " + " | ".join(row) + " |" for row in latency_rows(report)],
        "",
        *[f"- {line}" for line in timing_lines(report)],
        "",
    ]
    skipped = report.skipped_backends()
    if skipped:
        lines += ["Skipped backends:", "", *[f"- {name}: {reason}" for name, reason in skipped.items()], ""]
    lines += [
        "## Parity against PyTorch fp32 on the CPU",
        "",
        "| model | backend | max abs | max rel | min cosine | top-1 agreement |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {model} | {backend} | {n.max_abs:.2e} | {n.max_rel:.2e} | {n.cosine:.6f} | "
        f"{_fmt(n.top1_agreement, '.3f')} |"
        for model, backends in report.parity.items()
        for backend, n in backends.items()
    ]
    if report.attention:
        lines += ["", "## Attention kernels PyTorch ran", "", "| backend | dense | compressed |", "|---|---|---|"]
        lines += [f"| {backend} | {k['dense']} | {k['compressed']} |" for backend, k in report.attention.items()]
    lines += ["", "## Fidelity of the compressed model against the dense one", "", fidelity_summary(report), ""]
    said = (report.fidelity.data or {}).get("warnings") or []
    lines += [*(f"- warning: {message}" for message in said), *([""] if said else [])]
    lines += int8_markdown(report.int8)
    if report.gate:
        gate = report.gate
        lines += [
            "## Regression gate",
            "",
            "passed" if gate.passed else "**failed**:",
            "",
            *[f"- {item}" for item in gate.regressions],
            "",
        ]
    return "\n".join(lines)


def _torch_precision(report: BenchReport, lead: str) -> str:
    """``lead`` and the precision the PyTorch backends ran in (and CUDA graphs, where they replayed
    them); empty when the run had none (a report from before the precision was recorded ran fp32)."""
    settings = report.settings
    if settings is not None and not set(TORCH_FAMILIES) & set(settings.backends):
        return ""
    graphs = " with CUDA graphs on CUDA" if settings is not None and settings.cuda_graphs else ""
    return lead + (settings.torch_precision if settings is not None else "fp32") + graphs


#: What each row's ``timing`` means (:data:`benchmarks.backends.TIMINGS`, the CPU's one measurement).
TIMING_MEANINGS = {
    "device-resident": "images staged on the GPU once, outputs left there, CUDA events around each call",
    "host-to-host": "host arrays in and out (pinned on CUDA), the copies included",
    ON_THE_CPU: "on the CPU device-resident and host-to-host are one measurement, timed once",
}


def timing_lines(report: BenchReport) -> list[str]:
    """What the rows' timings mean, and what a row measured beside the figure gates compare: on a
    GPU the other timing (the second figure), with torch.compile the compile of each model."""
    lines = [f"{timing}: {TIMING_MEANINGS[timing]}" for timing in dict.fromkeys(r.timing for r in report.latency)]
    for r in report.latency:
        where = f"{r.backend}, batch {r.batch}"
        if r.second is not None:
            other = r.second
            lines.append(
                f"{where}, {other.timing}: dense {other.dense.p50_s * 1e3:.2f} ms, compressed "
                f"{other.compressed.p50_s * 1e3:.2f} ms, speedup {_spread(other.speedup)}"
            )
        if r.compile_s:
            lines.append(
                f"{where}: compiled in {r.compile_s['dense']:.1f} s (dense) and {r.compile_s['compressed']:.1f} s "
                "(compressed), apart from the timed calls"
            )
    return lines


def int8_markdown(int8: Int8Result | None) -> list[str]:
    """The int8 section (:mod:`benchmarks.int8`): latency of the four graphs and their fidelity."""
    if int8 is None:
        return []
    lines = ["## INT8 (ONNX Runtime CPU; the four graphs timed interleaved)", ""]
    if int8.skipped is not None:
        return lines + [f"Not measured: {int8.skipped}", ""]
    variants = list(int8.bytes)
    lines += [
        "| batch | "
        + " | ".join(f"{v} p50 (ms)" for v in variants)
        + " | compressed-int8 over dense-fp32 | int8 over fp32: compressed | int8 over fp32: dense |",
        "|" + "---|" * (len(variants) + 4),
    ]
    for r in int8.latency:
        ratios = [
            r.speedup_over_dense_fp32["compressed-int8"],
            r.int8_over_fp32["compressed"],
            r.int8_over_fp32["dense"],
        ]
        lines.append(
            f"| {r.batch} | "
            + " | ".join(f"{r.timings[v].p50_s * 1e3:.2f}" for v in variants)
            + " | "
            + " | ".join(_spread(s) for s in ratios)
            + " |"
        )
    lines += [
        "",
        "| graph | file (MB) | Linear layers in float | cosine vs dense fp32: mean | min | top-1 agreement |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {v} | {int8.bytes[v] / 1e6:.1f} | {int8.kept_float.get(v, 'all')} | {f.cosine_mean:.4f} | "
        f"{f.cosine_min:.4f} | {_fmt(f.top1_agreement)} |"
        for v, f in int8.fidelity.items()
    ]
    return lines + [""]


def plot(report: BenchReport, path: str | Path) -> None:
    """Throughput of both models and measured vs MAC-ideal speedup, per backend and batch size."""
    import matplotlib  # loaded when a picture is drawn: heavy, and its backend chosen first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    backends = sorted({r.backend for r in report.latency})
    for i, backend in enumerate(backends):
        rows = sorted((r for r in report.latency if r.backend == backend), key=lambda r: r.batch)
        batches = [r.batch for r in rows]
        color = f"C{i}"
        left.plot(batches, [r.dense.throughput_ips for r in rows], "--o", color=color, label=f"{backend} dense")
        left.plot(
            batches, [r.compressed.throughput_ips for r in rows], "-o", color=color, label=f"{backend} compressed"
        )
        medians = [r.speedup.median for r in rows]
        spread = [
            [m - r.speedup.p10 for m, r in zip(medians, rows)],
            [r.speedup.p90 - m for m, r in zip(medians, rows)],
        ]
        right.errorbar(batches, medians, yerr=spread, fmt="-o", color=color, capsize=3, label=backend)
    right.axhline(report.ideal_speedup, color="black", linestyle=":", label="MAC-ideal")
    all_batches = sorted({r.batch for r in report.latency})
    for ax, ylabel in ((left, "images / s"), (right, "speedup (dense / compressed)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_batches, [str(b) for b in all_batches])
        ax.minorticks_off()
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    left.set_title("Throughput")
    right.set_title("Measured speedup (p10-p90) vs MAC-ideal")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png", metadata={"Software": PLOT_SOFTWARE})
    plt.close(fig)


def print_terminal(report: BenchReport, console: Console | None = None) -> None:
    """Print the report's tables and lines on ``console`` (default: a new rich Console on stdout)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    torch_precision = _torch_precision(report, "; PyTorch ")
    title = f"corp-deploy bench (MAC-ideal speedup {report.ideal_speedup:.3f}x{torch_precision})"
    table = Table(title=title, pad_edge=False)  # 80 columns (a pipe's width) hold a CPU run's table
    for column in ("backend", "batch", "timing", "dense p50 ms", "compr. p50 ms", "speedup (p10-p90)", "of ideal"):
        table.add_column(column, justify="left" if column in ("backend", "timing") else "right", overflow="fold")
    for r in report.latency:
        table.add_row(
            r.backend,
            str(r.batch),
            r.timing,
            f"{r.dense.p50_s * 1e3:.1f}",
            f"{r.compressed.p50_s * 1e3:.1f}",
            _spread(r.speedup, ".2f"),
            f"{r.efficiency * 100:.0f}%",
        )
    console.print(table)
    for line in timing_lines(report):
        console.print(line)
    for name, reason in report.skipped_backends().items():
        console.print(f"skipped {name}: {reason}", style="yellow")
    worst = [(n.cosine, f"{model} on {backend}") for model, b in report.parity.items() for backend, n in b.items()]
    if worst:
        cosine, where = min(worst)
        console.print(f"parity vs torch-cpu: worst cosine {cosine:.6f} ({where})")
    for backend, kernels in report.attention.items():
        console.print(f"attention kernels on {backend}: dense {kernels['dense']}; compressed {kernels['compressed']}")
    console.print("fidelity: " + fidelity_summary(report))
    int8 = report.int8
    if int8 is not None and int8.skipped is not None:
        console.print(f"int8 not measured: {int8.skipped}", style="yellow")
    elif int8 is not None:
        for r in int8.latency:
            over_dense, over_fp32 = r.speedup_over_dense_fp32["compressed-int8"], r.int8_over_fp32["compressed"]
            console.print(
                f"int8, batch {r.batch}: compressed-int8 {over_dense.median:.2f}x over dense-fp32, "
                f"{over_fp32.median:.2f}x over compressed-fp32"
            )
        f = int8.fidelity["compressed-int8"]
        console.print(
            f"int8 fidelity: compressed-int8 vs dense fp32 cosine {f.cosine_mean:.4f} "
            f"(compressed-fp32 {int8.fidelity['compressed-fp32'].cosine_mean:.4f})"
        )


#: The renderings of a bench report and their file names in an output folder (``bench -o DIR``).
RENDERINGS = {"json": "bench.json", "markdown": "bench.md", "plot": "bench.png"}
#: The PNG text chunk that marks a plot as bench's own (so a later run may replace it).
PLOT_SOFTWARE = "corp-deploy bench"


def check_report_file(path: str | Path, rendering: str) -> Path:
    """CorpError, before any work, unless ``path`` can take the ``rendering`` (``json``,
    ``markdown``, ``plot``): its folder can be written, the plot is a ``.png``, and an existing
    file there is one that bench wrote (a bench JSON report, a bench Markdown report, a plot
    bench marked); bench never overwrites anything else."""
    given = Path(path)
    if given.exists() and not (given.is_file() or given.is_dir()):  # /dev/stdout, a FIFO, a device
        raise BadUsage(f"{given} is not a file path (a device, pipe or socket): bench writes its reports to files")
    path = resolve(given)
    if rendering == "plot" and path.suffix.lower() != ".png":
        raise BadUsage(f"--plot writes a PNG image; {given} does not end in .png")
    if path.is_dir():
        raise CorpError(f"{given} is a directory; give a file path (or use -o DIR)")
    if path.exists() and not _written_by_bench(path, rendering):
        raise CorpError(
            f"refusing to overwrite {given}: it is not a bench {rendering} file as corp-deploy wrote it "
            "(another file, or edited since); nothing was changed"
        )
    owner = enclosing_output(path)
    if owner is not None:
        raise CorpError(
            f"{given} lies inside {owner}, an output of corp-deploy, which holds only the files its "
            "record lists; write it elsewhere"
        )
    check_creatable(path, given)
    note_planned(path)
    return path


def check_report_outputs(
    files: dict[str, str | Path | None], folder: str | Path | None, baseline: str | Path | None = None
) -> tuple[dict[str, Path], Path | None]:
    """The report files asked for (``{rendering: path or None}``) and the ``-o`` folder, checked
    before any work (:func:`check_report_file`, :func:`corp_deploy.outputs.check_output_dir`):
    ``({rendering: path}, folder or None)``. CorpError when a file lies inside the folder, two
    renderings name one file, or a report would replace the ``baseline`` the run is gated against
    (a failing run would become the next run's baseline)."""
    checked = {rendering: check_report_file(path, rendering) for rendering, path in files.items() if path is not None}
    out_dir = check_output_dir(folder, "bench") if folder is not None else None
    inside = [path for path in checked.values() if out_dir is not None and out_dir in path.parents]
    if inside:
        raise CorpError(
            f"{inside[0]} lies inside -o {folder}; write it there without --json/--markdown/--plot, or elsewhere"
        )
    if len(set(checked.values())) < len(checked):
        raise BadUsage("--json, --markdown and --plot must name different files")
    if baseline is not None:
        kept = Path(baseline).resolve()
        if kept in {path.resolve() for path in checked.values()} or (
            out_dir is not None and out_dir.resolve() in kept.parents
        ):
            raise CorpError(
                f"the reports would replace --baseline {baseline}, the run this one is checked against "
                "(a failing run would become the next baseline); write them elsewhere and update the "
                "baseline deliberately"
            )
    return checked, out_dir


def _written_by_bench(path: Path, rendering: str) -> bool:
    try:
        if rendering == "json":
            return _unedited_json(path.read_text())
        if rendering == "markdown":
            return _unedited_markdown(path.read_text())
        from PIL import Image

        with Image.open(path) as image:
            return getattr(image, "text", {}).get("Software") == PLOT_SOFTWARE
    except (OSError, ValueError, AttributeError):
        return False


#: The last line of a bench Markdown report: the SHA-256 of everything above it, so that a later run
#: replaces the report only while nobody has edited it.
_MARKDOWN_DIGEST = "<!-- corp-deploy bench: sha256 {} of the text above -->\n"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _signed_markdown(text: str) -> str:
    return text + _MARKDOWN_DIGEST.format(_sha256(text))


def _unedited_markdown(text: str) -> bool:
    """Whether ``text`` is a bench Markdown report as bench wrote it: its title first and its digest
    line last, matching (a report without the digest line is not known to be bench's)."""
    if not text.startswith(MARKDOWN_TITLE):
        return False
    body, _, _ = text.rstrip("\n").rpartition("\n")
    return _signed_markdown(body + "\n") == text


#: The last entry of a bench JSON report: the SHA-256 of the JSON text of the entries before it
#: (a reader of the report ignores it, as any entry it does not know).
_JSON_DIGEST = "sha256_of_the_report_above"


def _signed_json(report: BenchReport) -> str:
    data = report.to_dict()
    return json_text({**data, _JSON_DIGEST: _sha256(json_text(data))})


def _unedited_json(text: str) -> bool:
    """Whether ``text`` is a bench JSON report as bench wrote it: its format, and its digest matching
    the other entries (a report without the digest is not known to be bench's)."""
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("format") != BENCH_FORMAT.name or _JSON_DIGEST not in data:
        return False
    digest = data.pop(_JSON_DIGEST)
    return _sha256(json_text(data)) == digest


def write_outputs(report: BenchReport, files: dict[str, Path], folder: Path | None = None) -> list[Path]:
    """Write the renderings in ``files`` (``{rendering: path}``) and, with ``folder``, the others
    into that folder as one output (:func:`corp_deploy.outputs.staged_output`); each file atomically."""
    writers = {
        "json": lambda p: p.write_text(_signed_json(report)),
        "markdown": lambda p: p.write_text(_signed_markdown(to_markdown(report))),
        "plot": lambda p: plot(report, p),
    }
    files = {rendering: Path(path) for rendering, path in files.items()}
    for path in files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_files(files.values()) as temporary:  # the files replaced together, or none
        for rendering, path in files.items():
            writers[rendering](temporary[path])
    for path in files.values():
        mark_complete(path)
    written = list(files.values())
    if folder is not None:
        with staged_output(folder, "bench") as tmp:
            for rendering, name in RENDERINGS.items():
                if rendering not in files:
                    writers[rendering](tmp / name)
        written += [Path(folder) / name for rendering, name in RENDERINGS.items() if rendering not in files]
    return written
