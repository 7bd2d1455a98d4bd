"""What recovery shows: its progress on stderr (:class:`_Progress`) and its report as a table
(:func:`recovery_table`)."""

from __future__ import annotations

import time


class _Progress:
    """Progress on stderr: on a terminal a bar with the steps, the running loss, the last validation
    cosine and the time left; elsewhere (a CI log) one line per validation measurement."""

    def __init__(self, enabled: bool, steps: int, start_cosine: float) -> None:
        self._bar = self._console = None
        self._steps, self._done, self._loss, self._started = steps, 0, float("nan"), time.perf_counter()
        if not enabled:
            return
        from rich.console import Console

        console = Console(stderr=True)
        if not console.is_terminal:
            self._console = console
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(
            TextColumn("recovering"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  validation cosine {task.fields[cosine]}"),
            TimeRemainingColumn(),
            console=console,
        )
        self._task = self._bar.add_task("", total=steps, loss="-", cosine=f"{start_cosine:.4f}")

    def __enter__(self) -> _Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def step(self, loss: float) -> None:
        self._done, self._loss = self._done + 1, loss
        if self._bar is not None:
            self._bar.update(self._task, advance=1, loss=f"{loss:.4f}")

    def validated(self, cosine: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, cosine=f"{cosine:.4f}")
        elif self._console is not None:
            elapsed = time.perf_counter() - self._started
            left = elapsed / self._done * (self._steps - self._done)
            self._console.print(
                f"recovering: step {self._done}/{self._steps}, loss {self._loss:.4f}, validation cosine "
                f"{cosine:.4f}, {elapsed:.0f} s so far, about {left:.0f} s left",
                highlight=False,
                soft_wrap=True,
            )


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
