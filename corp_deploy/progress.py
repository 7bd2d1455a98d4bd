"""Progress on standard error, for compression (:class:`CompressionProgress`) and recovery
(:class:`RecoveryProgress`): a rich bar on a terminal; elsewhere (a CI log, a file) nothing for
compression, a line per validation measurement for recovery. Disabled (``enabled=False``), every
call does nothing. Each is a context manager: the bar shows while the work runs."""

from __future__ import annotations

import time


class _StderrProgress:
    """The shared part: the console on standard error and, on a terminal, the bar of the
    subclass's :meth:`_columns`, started on enter and stopped on exit."""

    def __init__(self, enabled: bool) -> None:
        self._bar = self._console = None
        if not enabled:
            return
        import rich.progress
        from rich.console import Console

        self._console = Console(stderr=True)
        if self._console.is_terminal:
            self._bar = rich.progress.Progress(*self._columns(rich.progress), console=self._console)

    def _columns(self, progress) -> tuple:
        """The bar's columns, made from rich's ``progress`` module."""
        raise NotImplementedError

    def __enter__(self):
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()


class CompressionProgress(_StderrProgress):
    """Images loaded and embedded, then blocks calibrated; nothing off a terminal."""

    def __init__(self, enabled: bool) -> None:
        super().__init__(enabled)
        if self._bar is not None:
            self._images = self._bar.add_task("loading calibration images", total=None)

    def _columns(self, progress) -> tuple:
        return (
            progress.TextColumn("{task.description}"),
            progress.BarColumn(),
            progress.MofNCompleteColumn(),
            progress.TimeElapsedColumn(),
        )

    def images(self, count: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._images, count)

    def start_blocks(self, total: int) -> None:
        if self._bar is not None:
            done = self._bar.tasks[0].completed
            self._bar.update(self._images, total=done, completed=done)
            self._blocks = self._bar.add_task("calibrating blocks", total=total)

    def block_done(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._blocks)


class RecoveryProgress(_StderrProgress):
    """On a terminal a bar with the steps, the running loss, the last validation cosine and the
    time left; elsewhere (a CI log) one line per validation measurement."""

    def __init__(self, enabled: bool, steps: int, start_cosine: float) -> None:
        super().__init__(enabled)
        self._steps, self._done, self._loss, self._started = steps, 0, float("nan"), time.perf_counter()
        if self._bar is not None:
            self._task = self._bar.add_task("", total=steps, loss="-", cosine=f"{start_cosine:.4f}")

    def _columns(self, progress) -> tuple:
        return (
            progress.TextColumn("recovering"),
            progress.BarColumn(),
            progress.MofNCompleteColumn(),
            progress.TextColumn("loss {task.fields[loss]}  validation cosine {task.fields[cosine]}"),
            progress.TimeRemainingColumn(),
        )

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
