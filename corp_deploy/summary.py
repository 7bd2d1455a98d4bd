"""The compress report as the tables ``corp-deploy compress`` prints (:func:`summary_tables`)."""

from __future__ import annotations

from .methods import METHODS
from .parts import PARTS
from .recovery import recovery_table


def summary_tables(report: dict, path) -> list:
    """The compress ``report`` of :func:`compress` as rich tables: parameters, MACs, the mean
    relative error of every pruned part (sliced and compensated) and the wall time, then the
    method's own tables (CORP's budget allocation). ``path``: where the artifact was written."""
    from rich.table import Table

    layers = report["layers"]
    table = Table(title=f"corp-deploy compress ({report['method']}) -> {path}")
    table.add_column("", overflow="fold")  # wrapped, never cut: a narrow terminal loses no digit
    table.add_column("before", justify="right", overflow="fold")
    table.add_column("after", justify="right", overflow="fold")
    p, m = report["params"], report["macs"]
    table.add_row("parameters (M)", f"{p['dense'] / 1e6:.2f}", f"{p['compressed'] / 1e6:.2f}")
    table.add_row("GMACs / image", f"{m['dense'] / 1e9:.4g}", f"{m['compressed'] / 1e9:.4g}")
    for part in PARTS.values():
        rows = [
            layer[part.report_key] for layer in layers if "relative_error_compensated" in layer.get(part.report_key, {})
        ]
        if rows:
            unc = sum(r["relative_error_uncompensated"] for r in rows) / len(rows)
            comp = sum(r["relative_error_compensated"] for r in rows) / len(rows)
            table.add_row(f"{part.error_label} rel. error (sliced, compensated)", f"{unc:.4f}", f"{comp:.4f}")
    table.add_row("compress wall time (s)", "", f"{report['time_s']['total']:.1f}")
    recovery = [recovery_table(report["recovery"])] if "recovery" in report else []
    return [table, *METHODS[report["method"]].report_tables(report), *recovery]
