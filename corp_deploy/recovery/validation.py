"""Recovery's validation (:class:`Validation`): the student measured on the held-out views, as they
are and distorted, with the blended weights; the rule for a better measurement (:data:`MIN_GAIN`,
never below compression on the distorted views), the best so far and early stopping."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .. import distributed
from ..metrics import tensor_cosine
from .config import RecoveryConfig
from .images import RecoveryImages
from .training import _Distillation

#: The least gain of the validation cosine over the best measurement so far for recovery to keep a
#: step: a smaller one is float32 rounding (a nearly exact compression "gained" 2e-8 and had its
#: weights replaced).
MIN_GAIN = 1e-5


class Validation:
    """The validation of one recovery ``run`` on ``images``' held-out views: the teacher's outputs
    on them (made once), the measurement before the first step (made here: compression's), then
    :meth:`measured` at each validation step; :attr:`best` holds the best measurement's step, both
    cosines and weights (compression's until a measurement is better), :attr:`curve` every one.
    ``on_measure(step, student)``: as :func:`~corp_deploy.recovery.recover` says."""

    def __init__(
        self,
        run: _Distillation,
        images: RecoveryImages,
        config: RecoveryConfig,
        on_measure: Callable[[int, nn.Module], None] | None = None,
    ) -> None:
        self._run, self._config, self._on_measure = run, config, on_measure
        self._references = self.reference(images.validation), self.reference(images.distorted)
        cosine, distorted, weights = self.measure(0)
        self.start = {"cosine": cosine, "distorted": distorted}
        self.best = {"step": 0, "cosine": cosine, "distorted": distorted, "weights": weights}
        self.curve = [{"step": 0, "loss": None, "validation_cosine": cosine, "distorted_cosine": distorted}]
        self._stale = 0

    @torch.no_grad()
    def reference(self, images: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This process's share of ``images`` (under torch.distributed), in batches, each with the
        teacher's outputs on it (pooled features or logits): what :meth:`validate` compares with."""
        run = self._run
        device = next(run.student.parameters()).device
        share = images[distributed.rank() :: distributed.world_size()]
        batches = [
            share[i : i + self._config.batch_size].to(device) for i in range(0, len(share), self._config.batch_size)
        ]
        with run.autocast():
            return [(x, run.teacher(x).float().flatten(1)) for x in batches]

    @torch.no_grad()
    def validate(self, reference: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean over the images of ``reference`` (:meth:`reference`) of the cosine between the
        student's outputs and the teacher's; under torch.distributed the processes' sums are added."""
        cosines, count = 0.0, 0
        for x, target in reference:
            with self._run.autocast():
                output = self._run.student(x).float().flatten(1)
            cosines += float(tensor_cosine(output, target).double().sum())
            count += len(x)
        cosines, count = distributed.sum_floats(cosines, count)
        return cosines / count

    def measure(self, step: int) -> tuple[float, float, dict[str, torch.Tensor]]:
        """Both validation cosines of the student with the blended weights, and those weights."""
        with self._run.blended() as weights:
            cosine, distorted = (self.validate(reference) for reference in self._references)
            if self._on_measure is not None:
                self._on_measure(step, self._run.student)
        return cosine, distorted, weights

    def measured(self, step: int, loss: float | None) -> str | None:
        """Measure at ``step`` (``loss``: the running training loss), keep the measurement where it
        is better; why recovery stops now, or None. Better: the cosine on the views as they are beats
        the best so far by more than :data:`MIN_GAIN` (float rounding) and the distorted views' is
        not below compression's."""
        cosine, distorted, weights = self.measure(step)
        self.curve.append({"step": step, "loss": loss, "validation_cosine": cosine, "distorted_cosine": distorted})
        better = cosine > self.best["cosine"] + MIN_GAIN and distorted >= self.start["distorted"]
        self._stale = 0 if better else self._stale + 1
        if better:
            self.best = {"step": step, "cosine": cosine, "distorted": distorted, "weights": weights}
        if self._stale >= self._config.patience:
            plural = "s" if self._config.patience > 1 else ""
            return f"validation did not improve in {self._config.patience} measurement{plural}"
        return None

    @property
    def last_cosine(self) -> float:
        """The cosine on the views as they are of the last measurement."""
        return self.curve[-1]["validation_cosine"]
