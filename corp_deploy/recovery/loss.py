"""What recovery's loss compares: each model's :class:`Outputs` (the block outputs captured by
hooks, the final features, the pooled output), :func:`distillation_loss` between the student's and
the teacher's, and :func:`check_teacher`, that the teacher is the dense model the student was
compressed from."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import CorpError
from ..families import blocks_of, family_of
from ..metrics import tensor_cosine


class _BlockOutputs:
    """The residual stream after every block of ``model``, captured on each forward (a hook per
    block); ``clear()`` before a forward, ``remove()`` when done."""

    def __init__(self, model: nn.Module) -> None:
        self.outputs: list[torch.Tensor] = []
        self._handles = [b.register_forward_hook(lambda m, i, o: self.outputs.append(o)) for b in blocks_of(model)]

    def clear(self) -> None:
        self.outputs = []

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass
class Outputs:
    """What the loss compares of one model on a batch: the residual stream after every block (each
    ``(B, N, C)``, or a Swin's ``(B, H, W, C)``), the final features (``forward_features``) and the
    pooled output (``forward_head(..., pre_logits=True)``, ``(B, C)``: what a classifier reads)."""

    blocks: list[torch.Tensor]
    features: torch.Tensor
    pooled: torch.Tensor


def distillation_loss(student: Outputs, teacher: Outputs, final_weight: float, pooled_weight: float) -> torch.Tensor:
    """Mean over blocks of the mean over tokens of ``1 - cos`` between the residual streams
    (cosine over channels), plus ``final_weight`` times the same for the final features and
    ``pooled_weight`` times the mean over images of ``1 - cos`` between the pooled outputs; a
    scalar in float32."""

    def distance(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (1 - tensor_cosine(s.float(), t.float())).mean()

    blocks = torch.stack([distance(s, t) for s, t in zip(student.blocks, teacher.blocks)]).mean()
    return (
        blocks
        + final_weight * distance(student.features, teacher.features)
        + pooled_weight * distance(student.pooled, teacher.pooled)
    )


def check_teacher(student: nn.Module, teacher: nn.Module) -> None:
    """CorpError unless ``teacher`` can be the dense model ``student`` was compressed from: the same
    number of blocks and classes and the same patch embedding (which compression never changes),
    both in float32 (recovery trains in float32; on CUDA its forward passes may autocast)."""
    if family_of(teacher) is None or not isinstance(getattr(teacher, "patch_embed", None), nn.Module):
        raise CorpError(
            f"the dense model ({type(teacher).__name__}) is not a timm ViT this one could be compressed from"
        )
    if getattr(student, "num_classes", None) != getattr(teacher, "num_classes", None):
        raise CorpError(
            f"the dense model has {teacher.num_classes} classes and the compressed one {student.num_classes}: "
            "it is not the model this one was compressed from"
        )
    if len(blocks_of(student)) != len(blocks_of(teacher)):
        raise CorpError(
            f"the dense model has {len(blocks_of(teacher))} blocks and the compressed one "
            f"{len(blocks_of(student))}: it is not the model this one was compressed from"
        )
    for model, which in ((student, "compressed"), (teacher, "dense")):
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()})
        if dtypes != ["float32"]:
            raise CorpError(
                f"the {which} model's weights are {', '.join(dtypes) or 'none'}: recovery trains float32 models "
                "(convert it with model.float() first)"
            )
    ours, theirs = student.patch_embed.state_dict(), teacher.patch_embed.state_dict()
    if ours.keys() != theirs.keys() or any(not torch.equal(ours[k], theirs[k].to(ours[k].device)) for k in ours):
        raise CorpError(
            "the dense model's patch embedding differs from the compressed model's: these are not the "
            "weights it was compressed from (give the dense model compress started from)"
        )
