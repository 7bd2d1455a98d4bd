"""A recovery's report as a table (:func:`recovery_table`); its progress is
:class:`corp_deploy.progress.RecoveryProgress`."""

from __future__ import annotations


def recovery_table(report: dict, path=None):
    """A recovery's report (:func:`recover`) as a rich table: steps run and why it stopped, the
    best step, the validation cosine before and after (only before, when no step was kept), and the time."""
    from rich.table import Table

    kept = report["best_step"]

    def change(cosines: dict) -> str:
        before = f"{cosines['compressed']:.4f}"
        return f"{before} -> {cosines['recovered']:.4f}" if kept else f"{before} (before any step)"

    table = Table(title="recovery" + (f" -> {path}" if path else ""))
    table.add_column("", overflow="fold")
    table.add_column("", justify="right", overflow="fold")
    table.add_row("steps run", f"{report['steps_run']} ({report['stopped']})")
    table.add_row("weights kept from step", str(kept) if kept else "none: no measurement beat compression's")
    images = report["images"]
    table.add_row(
        f"validation output cosine ({images['validation_views']} views of "
        f"{images['validation_sources']} held-out image{'s' if images['validation_sources'] != 1 else ''})",
        change(report["validation_cosine"]),
    )
    table.add_row("the same images distorted (colour, greyscale, blur)", change(report["distorted_validation_cosine"]))
    table.add_row("recovery wall time (s)", f"{report['time_s']:.1f}")
    return table
