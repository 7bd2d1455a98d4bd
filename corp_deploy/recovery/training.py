"""Recovery's training state (:class:`_Distillation`): the parameters that train
(:func:`trainable_parameters`), the optimiser and its schedule, one step of the loss, the blend of
the trained change into compression's weights, and DistributedDataParallel under torch.distributed."""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from .. import distributed
from ..errors import CorpError
from ..families import blocks_of
from .config import RecoveryConfig
from .loss import Outputs, _BlockOutputs, distillation_loss


def _lr_factor(step: int, config: RecoveryConfig) -> float:
    """The learning rate at ``step`` (0-based) as a fraction of ``config.lr``: linear warmup, then cosine."""
    warmup = round(config.warmup * config.steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, config.steps - warmup)))


def trainable_parameters(model: nn.Module, train: str = "all", final_norm: bool = True) -> dict[str, nn.Parameter]:
    """The parameters recovery trains (:data:`TRAINED`), by name: those of the blocks and, with
    ``final_norm`` (the final features are in the loss), of the final norm ``forward_features``
    applies (``norm``; a pooled model's ``fc_norm`` comes after the pooling, outside the loss, and
    does not train), or only the vectors among them (one-dimensional: norm weights and biases,
    biases, layer scales)."""
    owners = [*blocks_of(model), getattr(model, "norm", None) if final_norm else None]
    ids = {id(p) for module in owners if isinstance(module, nn.Module) for p in module.parameters()}
    return {name: p for name, p in model.named_parameters() if id(p) in ids and (train == "all" or p.dim() == 1)}


class _Features(nn.Module):
    """``model.forward_features`` as a module's forward, for DistributedDataParallel (which
    synchronises the gradients of what runs through its wrapped module's forward)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.forward_features(images)


class _Distillation:
    """One recovery's training state: the student's trained parameters (the others frozen, their
    ``requires_grad`` given back by :meth:`close`), the optimiser and schedule, the hooks on both
    models' blocks, and the student behind DistributedDataParallel under torch.distributed."""

    def __init__(self, student: nn.Module, teacher: nn.Module, config: RecoveryConfig) -> None:
        self.student, self.teacher, self.config = student, teacher, config
        device = next(student.parameters()).device
        self.bf16 = config.autocast_bf16 and device.type == "cuda"
        if config.checkpointing:
            student.set_grad_checkpointing(True)
        self.trained = trainable_parameters(student, config.train, final_norm=config.final_weight > 0)
        self._requires_grad = {name: p.requires_grad for name, p in student.named_parameters()}
        for name, parameter in student.named_parameters():
            parameter.requires_grad_(name in self.trained)
        self._features = _Features(student)
        if distributed.active():
            self._features = nn.parallel.DistributedDataParallel(self._features)
        self.compressed = self.weights()
        self.optimizer = torch.optim.AdamW(list(self.trained.values()), lr=config.lr, weight_decay=config.weight_decay)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: _lr_factor(step, config))
        self._teacher_blocks, self._student_blocks = _BlockOutputs(teacher), _BlockOutputs(student)

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.bf16 else nullcontext()

    def step(self, x: torch.Tensor, step: int) -> float:
        """One optimisation step on this process's share ``x`` of the batch; the loss, averaged
        over the processes. CorpError if it is not finite."""
        self._teacher_blocks.clear(), self._student_blocks.clear()
        with torch.no_grad(), self.autocast():
            features = self.teacher.forward_features(x)
            teacher = Outputs(
                self._teacher_blocks.outputs, features, self.teacher.forward_head(features, pre_logits=True)
            )
        with self.autocast():
            features = self._features(x)
            student = Outputs(
                self._student_blocks.outputs, features, self.student.forward_head(features, pre_logits=True)
            )
        loss = distillation_loss(student, teacher, self.config.final_weight, self.config.pooled_weight)
        if not torch.isfinite(loss):
            raise CorpError(
                f"recovery stopped at step {step} of {self.config.steps}: the loss is not finite "
                f"({float(loss.detach())}); nothing was written (try a lower --recover-lr)"
            )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.schedule.step()
        return distributed.sum_floats(float(loss.detach()))[0] / distributed.world_size()

    @contextmanager
    def blended(self):
        """The student with the recovered weights (``config.blend`` of the trained change kept)
        for the ``with`` block, which is given a copy of them; the trained weights after it."""
        trained = self.weights()
        with torch.no_grad():
            for name, parameter in self.trained.items():
                parameter.copy_(self.compressed[name] + self.config.blend * (trained[name] - self.compressed[name]))
        try:
            yield self.weights()
        finally:
            with torch.no_grad():
                for name, parameter in self.trained.items():
                    parameter.copy_(trained[name])

    def weights(self) -> dict[str, torch.Tensor]:
        """A copy of the trained parameters."""
        return {name: p.detach().clone() for name, p in self.trained.items()}

    def close(self, weights: dict[str, torch.Tensor]) -> None:
        """Put ``weights`` into the student, remove the hooks, give back ``requires_grad``."""
        with torch.no_grad():
            for name, parameter in self.trained.items():
                parameter.copy_(weights[name])
        self._teacher_blocks.remove(), self._student_blocks.remove()
        if self.config.checkpointing:
            self.student.set_grad_checkpointing(False)
        for name, parameter in self.student.named_parameters():
            parameter.requires_grad_(self._requires_grad[name])
