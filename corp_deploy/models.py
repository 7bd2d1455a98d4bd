"""Building the base timm Vision Transformer: names, weights and supported structure."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn
from timm.layers import HybridEmbed, Mlp, PatchEmbed
from timm.layers.attention import Attention
from timm.models import beit, cait, eva, swin_transformer as swin
from timm.models.vision_transformer import Block, VisionTransformer
from timm.models.vision_transformer_relpos import RelPosAttention, RelPosBlock, VisionTransformerRelPos

from .errors import CorpError, first_line
from .families import ScaledResidualBlock, WindowedBlock, blocks_of, eva_rotary_embedding, standard_form
from .layers import GatedLinear, PrunedAttention, head_dims

ALIASES = {
    "deit_tiny": "deit_tiny_patch16_224",
    "deit_small": "deit_small_patch16_224",
    "deit_base": "deit_base_patch16_224",
    "deit3_small": "deit3_small_patch16_224",
    "deit3_base": "deit3_base_patch16_224",
    "vit_tiny": "vit_tiny_patch16_224",
    "vit_small": "vit_small_patch16_224",
    "vit_base": "vit_base_patch16_224",
    "dinov2_small": "vit_small_patch14_dinov2",
    "dinov2_base": "vit_base_patch14_dinov2",
}
SUPPORTED_FAMILIES = ("timm VisionTransformer models built from its standard Block (Attention + Mlp) on a "
                      "PatchEmbed or a CNN stem (HybridEmbed): deit_*, deit3_*, most vit_*, *_dinov2 (incl. "
                      "distilled DeiT), vit_*_r_* hybrids; VisionTransformerRelPos with per-block relative "
                      "position bias (vit_relpos_*); Beit with per-block relative position bias (beit_*, "
                      "beitv2_*); Eva of pre-norm EvaBlocks with EvaAttention without qk-norm or inner norm "
                      "(eva02_* image models, eva_giant_*, *_dinov3 with dynamic_img_size=False, vit_*_rope_reg*; "
                      "MLP and value/output dims where there is a rotary embedding); Cait (cait_*: MLPs of the "
                      "self-attention blocks only); SwinTransformer (swin_*: windowed attention with relative "
                      "position bias, patch merging kept dense)")


def resolve_model_name(name: str, model_kwargs: dict[str, Any] | None = None) -> str:
    """Full timm name for ``name`` (an alias or a timm name).

    CorpError if timm does not know it, or if the model it builds with ``model_kwargs`` (checked
    on the meta device: no weights, no memory) has a structure corp-deploy cannot compress; the
    message names the class that is not supported.
    """
    full = ALIASES.get(name, name)
    base = full.split(".")[0]  # allow pretrained tags: deit_base_patch16_224.fb_in1k
    if not timm.is_model(base):
        raise CorpError(f"unknown model {name!r}; supported: {SUPPORTED_FAMILIES} "
                        f"(aliases: {', '.join(sorted(ALIASES))})")
    skeleton = _skeleton(base, model_kwargs or {})
    problem = structure_problem(skeleton)
    if problem is not None:
        raise CorpError(f"{name} cannot be compressed: {problem}. Supported: {SUPPORTED_FAMILIES}")
    return full


def _skeleton(name: str, kwargs: dict[str, Any]) -> nn.Module:
    """timm's ``name`` built with ``kwargs`` on the meta device (no weights, no memory); where a model
    cannot be built there, on the CPU. CorpError, in one line, when timm refuses the arguments."""
    for device in ("meta", "cpu"):
        try:
            with torch.device(device):
                return timm.create_model(name, pretrained=False, **kwargs)
        except Exception as exc:  # noqa: BLE001 - timm raises TypeError, ValueError, AssertionError, ...
            error = exc
    raise CorpError(f"timm cannot build {name} with {_given(kwargs)}: {first_line(error)}")


def create_base_model(name: str, model_kwargs: dict[str, Any] | None = None, *,
                      pretrained: bool = True, checkpoint: str | Path | None = None,
                      seed: int | None = None) -> nn.Module:
    """The dense timm model in eval mode.

    Weights come from ``checkpoint`` (a local state dict) when given, else from timm's
    pretrained weights when ``pretrained``, else random initialisation (reproducible when
    ``seed`` is given: the torch RNG is seeded right before the model is created).
    """
    full = resolve_model_name(name, model_kwargs)
    kwargs = dict(model_kwargs or {})
    use_hub = pretrained and checkpoint is None
    if use_hub and not _hub_reachable():
        raise CorpError(
            f"cannot reach the Hugging Face hub to download pretrained weights for {full}. "
            "Pass local weights with --checkpoint FILE (safetensors or .pth state dict), "
            "use --no-pretrained for random weights, or set HF_HUB_OFFLINE=1 to use weights "
            "already in the local Hugging Face cache.")
    if seed is not None:
        torch.manual_seed(seed)
    try:
        model = timm.create_model(full, pretrained=use_hub, **kwargs)
    except TypeError as exc:
        raise CorpError(f"bad model argument for {full}: {exc}") from None
    except Exception as exc:  # network / hub errors come in many types
        if not use_hub:
            raise CorpError(f"could not build {full} with {kwargs}: {exc}") from None
        raise CorpError(
            f"could not fetch pretrained weights for {full} ({type(exc).__name__}: "
            f"{first_line(exc)}). "
            "Without network access, pass local weights with --checkpoint FILE "
            "(safetensors or .pth state dict) or use --no-pretrained for random weights.") from None
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    check_vit(model)
    check_finite(model, f"the weights of {full}" + (f" from {checkpoint}" if checkpoint is not None else ""))
    model = standard_form(model).eval()
    _check_runs(model, full, kwargs)
    return model


def _check_runs(model: nn.Module, name: str, kwargs: dict[str, Any]) -> None:
    """CorpError, in one line, when ``model`` cannot run one blank image of its input size (timm
    accepts some arguments it cannot run with, e.g. a NaN drop rate)."""
    from .calibration import model_transform
    from .cost import forward_blank_image
    _, data_config = model_transform(model)
    try:
        forward_blank_image(model, tuple(data_config["input_size"]), lambda module: None)
    except Exception as exc:  # noqa: BLE001 - whatever the model raises, the arguments are the cause
        raise CorpError(f"{name} built with {_given(kwargs)} cannot run on an image: {first_line(exc)}") from None


def _given(kwargs: dict[str, Any]) -> str:
    """``--model-arg`` values as the user gave them, for messages."""
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "no --model-arg"


def check_finite(model: nn.Module, what: str) -> None:
    """CorpError naming the first parameter or buffer of ``model`` that holds NaN or infinity."""
    for key, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CorpError(f"{what}: {key} holds NaN or infinite values; these weights cannot be compressed")


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the weights hub answers a TCP connection (True when HF_HUB_OFFLINE is set,
    so that timm reads its local cache)."""
    import os
    import socket
    from urllib.parse import urlparse
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return True
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def load_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Load a local state dict strictly: safetensors, or a torch file read with weights_only=True."""
    path = Path(path)
    if not path.is_file():
        raise CorpError(f"checkpoint not found: {path}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CorpError(f"cannot read checkpoint {path}: {exc}") from None
    for key in ("state_dict", "model", "module"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) and v.layout == torch.strided
                                              for v in state.values()):
        raise CorpError(f"checkpoint {path} does not hold a state dict of dense tensors")
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    reshaped = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensors (e.g. {', '.join(missing[:2])})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensors (e.g. {', '.join(unexpected[:2])})")
    if reshaped:
        first = reshaped[0]
        problems.append(f"{len(reshaped)} tensors of other shapes (e.g. {first}: {list(state[first].shape)} in the "
                        f"checkpoint, {list(own[first].shape)} in the model)")
    if problems:
        raise CorpError(f"checkpoint {path} does not match the model: {'; '.join(problems)}. "
                        "Check the model name and --model-arg values (e.g. num_classes, img_size).")
    model.load_state_dict(state, strict=True)


def structure_problem(model: nn.Module) -> str | None:
    """Why corp-deploy cannot compress ``model``, naming the first class it does not support;
    None for a timm ``VisionTransformer`` of standard pre-norm blocks on a ``PatchEmbed`` or a
    ``HybridEmbed`` (a CNN stem whose feature map becomes the tokens; the stem is kept dense),
    and for a ``VisionTransformerRelPos`` of pre-norm ``RelPosBlock``s whose relative position
    bias belongs to each block (the bias is additive in the logits, docs/method.md §9), and for a
    ``Beit`` whose relative position bias belongs to each block and an ``Eva`` of pre-norm blocks whose
    attention has no qk-norm, inner norm or gate, and a ``Cait`` (all three rewritten by
    :func:`~corp_deploy.families.standard_form`; which parts can be pruned: :func:`check_prunable`), and a
    ``SwinTransformer`` of timm's (shifted) window blocks with a fixed shift mask."""
    grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if grid is not None and min(grid) < 1:
        return (f"its patch grid is {tuple(grid)}: the patches are larger than the image "
                "(check the img_size and patch_size --model-arg values)")
    families = (VisionTransformer, VisionTransformerRelPos, beit.Beit, eva.Eva, cait.Cait, swin.SwinTransformer)
    if isinstance(model, families) and not blocks_of(model):
        return "it has no transformer blocks (depth 0)"
    if isinstance(model, VisionTransformerRelPos):
        return _relpos_problem(model)
    if isinstance(model, beit.Beit):
        return _beit_problem(model)
    if isinstance(model, eva.Eva):
        return _eva_problem(model)
    if isinstance(model, cait.Cait):
        return _cait_problem(model)
    if isinstance(model, swin.SwinTransformer):
        return _swin_problem(model)
    if not isinstance(model, VisionTransformer):
        found = f"it builds a timm {type(model).__name__}"
        blocks = getattr(model, "blocks", None)
        has_blocks = isinstance(blocks, (nn.Sequential, nn.ModuleList)) and len(blocks) > 0
        if has_blocks:
            parts = ", ".join(f"{_class_path(getattr(blocks[0], part))} {label}"
                              for part, label in (("attn", "attention"), ("mlp", "MLP")) if hasattr(blocks[0], part))
            found += f" whose blocks are {_class_path(blocks[0])}" + (f" ({parts})" if parts else "")
        reason = _FAMILY_REASONS.get(type(model).__name__)
        if reason is not None:
            return f"{found}: {reason}"
        return found if has_blocks else f"{found}, which has no sequence of transformer blocks"
    if not isinstance(model.patch_embed, (PatchEmbed, HybridEmbed)):
        return (f"its patch embedding is a {_class_path(model.patch_embed)}, neither timm's PatchEmbed nor "
                "its HybridEmbed")
    for i, block in enumerate(model.blocks):
        if type(block) is not Block:
            return f"block {i} is a {type(block).__name__}, not timm's standard pre-norm Block"
    return None


#: Why the timm families that are refused as a whole cannot be compressed (by model class name).
_FAMILY_REASONS = {
    name: ("its blocks are post-norm and their attention is a scaled cosine of queries and keys plus a position "
           "bias computed by an MLP, so neither the block layout nor the query/key system of docs/method.md §3 "
           "applies; Swin v1 (swin_*) is supported")
    for name in ("SwinTransformerV2", "SwinTransformerV2Cr")
}


def _relpos_problem(model: VisionTransformerRelPos) -> str | None:
    if model.shared_rel_pos is not None:
        return ("it shares one relative position bias across blocks (VisionTransformerRelPos with "
                "use_shared_rel_pos=True), which is passed to every block and is not supported")
    for i, block in enumerate(model.blocks):
        if type(block) is not RelPosBlock:
            return f"block {i} is a {_class_path(block)}, not timm's pre-norm RelPosBlock"
    return None


def _beit_problem(model: beit.Beit) -> str | None:
    if model.rel_pos_bias is not None:
        return ("it shares one relative position bias across blocks (Beit with use_shared_rel_pos_bias=True), "
                "which is passed to every block and is not supported")
    for i, block in enumerate(model.blocks):
        if type(block) is ScaledResidualBlock:
            continue
        if type(block) is not beit.Block:
            return f"block {i} is a {_class_path(block)}, not timm's BEiT Block"
        if block.attn.qkv.out_features != 3 * block.attn.qkv.in_features:
            return (f"block {i}'s attention heads are {block.attn.qkv.out_features // 3 // block.attn.num_heads} "
                    "wide, not width / heads (attn_head_dim), which is not supported")
    return None


def _eva_problem(model: eva.Eva) -> str | None:
    if model.dynamic_img_size:
        return ("it is built with dynamic_img_size=True, whose rotary embedding changes with the image size; "
                "fix the size with --model-arg dynamic_img_size=false")
    if model.rope is not None:
        rope = eva_rotary_embedding(model)
        if getattr(model, "rope_mixed", False) or rope.dim() != 2 or rope.shape[-1] != 2 * head_dims(model.blocks[0].attn)[0]:
            return (f"its rotary embedding ({_class_path(model.rope)}) is not one (patches, 2 x head dim) table "
                    "shared by every block")
    for i, block in enumerate(model.blocks):
        if type(block) is ScaledResidualBlock:
            continue
        if type(block) is not eva.EvaBlock:
            return f"block {i} is a {_class_path(block)}, not timm's pre-norm EvaBlock"
        attn = block.attn
        if type(attn) is not eva.EvaAttention:
            return f"block {i}'s attention is a {_class_path(attn)}, not timm's EvaAttention"
        if not (isinstance(attn.q_norm, nn.Identity) and isinstance(attn.norm, nn.Identity) and attn.gate is None):
            return (f"block {i}'s attention has qk-norm, an inner norm (scale_attn_inner) or a gate, which the "
                    "rewritten attention does not compute")
        if attn.head_dim * attn.num_heads != attn.proj.out_features:
            return f"block {i}'s attention heads are {attn.head_dim} wide, not width / heads (attn_head_dim)"
    return None


def _cait_problem(model: cait.Cait) -> str | None:
    for i, block in enumerate(model.blocks):
        if type(block) not in (cait.LayerScaleBlock, ScaledResidualBlock):
            return f"block {i} is a {_class_path(block)}, not timm's CaiT LayerScaleBlock"
    return None


def _swin_problem(model: swin.SwinTransformer) -> str | None:
    for s, stage in enumerate(model.layers):
        if type(stage) is not swin.SwinTransformerStage:
            return f"stage {s} is a {_class_path(stage)}, not timm's SwinTransformerStage"
        for i, block in enumerate(stage.blocks):
            if type(block) is WindowedBlock:
                continue
            if type(block) is not swin.SwinTransformerBlock or type(block.attn) is not swin.WindowAttention:
                return f"stage {s} block {i} is a {_class_path(block)}, not timm's SwinTransformerBlock"
            if block.dynamic_mask:
                return (f"stage {s} block {i} computes its shift mask for each input (dynamic_mask=True), "
                        "which is not supported")
    return None


def _class_path(obj: object) -> str:
    """``module.Class`` of ``obj`` (timm reuses class names such as ``Block`` across families)."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def check_vit(model: nn.Module) -> None:
    """CorpError unless ``model`` has a structure corp-deploy can compress (see :func:`structure_problem`)."""
    problem = structure_problem(model)
    if problem is not None:
        raise CorpError(f"this model cannot be compressed: {problem}. Supported: {SUPPORTED_FAMILIES}")


def check_prunable(model: nn.Module, mlp: bool, qk: bool, vo: bool) -> None:
    """CorpError if a part asked to be pruned (MLP hidden channels, query/key dims, value/output
    dims) does not have the structure CORP assumes, saying why and which ``--target`` works."""
    for i, block in enumerate(blocks_of(model)):
        if mlp:
            m = block.mlp
            if type(m) is not Mlp or not isinstance(m.fc1, (nn.Linear, GatedLinear)):
                raise CorpError(f"block {i}: MLP of type {type(m).__name__} is not supported for MLP pruning "
                                "(needs timm Mlp: fc1 -> elementwise act -> fc2, or a gated MLP); use --target attn")
            if not isinstance(m.norm, nn.Identity):
                raise CorpError(f"block {i}: the MLP normalises its hidden channels before fc2 (sub-LN, timm "
                                "scale_mlp), so removing channels changes the kept ones and the compensation of "
                                "docs/method.md §2 does not hold; use --target vo (or attn where the model allows)")
        attn = block.attn
        if (qk or vo) and type(attn) is cait.TalkingHeadAttn:
            raise CorpError(f"block {i}: talking-heads attention mixes the heads' logits before and after the "
                            "softmax, so the per-head query/key and value compensation (docs/method.md §3-4) "
                            "does not apply; use --target mlp")
        if (qk or vo) and not is_prunable_attention(attn):
            raise CorpError(f"block {i}: attention of type {type(attn).__name__} (or with qk-norm, "
                            "scale-norm or gating) is not supported for query/key or value pruning; "
                            "use --target mlp")
        if qk and isinstance(attn, PrunedAttention):
            if attn.rope is not None:
                raise CorpError(f"block {i}: the attention rotates queries and keys by a rotary position embedding; "
                                "the query/key compensation of docs/method.md §3 mixes dims across rotation pairs, "
                                "which does not commute with the rotation (docs/method.md §9). Prune the MLP and "
                                "value/output dims instead: --target mlp-vo (or mlp, vo)")
            if attn.qk_head_dim != attn.v_head_dim or attn.scale != attn.qk_head_dim ** -0.5:
                raise CorpError(f"block {i}: the attention's query/key dims are already pruned; compress the dense "
                                "model instead")


def is_prunable_attention(attn: nn.Module) -> bool:
    """Whether CORP can prune ``attn``'s query/key and value dims: timm's plain ``Attention``
    (:func:`is_plain_attention`), a ``RelPosAttention`` without qk-norm (its relative position
    bias is added to the logits and kept), or a :class:`PrunedAttention` (the rewritten attention
    of Eva models with a rotary embedding, or an attention compressed before; its query/key dims
    are not prunable, see :func:`check_prunable`)."""
    if isinstance(attn, PrunedAttention):
        return True
    if type(attn) is RelPosAttention:
        return isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity)
    return is_plain_attention(attn)


def is_plain_attention(attn: nn.Module) -> bool:
    """Whether ``attn`` is timm's standard ``Attention`` without qk-norm, scale-norm or gating:
    ``softmax(scale * q k^T) v`` on one fused ``qkv`` projection, then ``proj``."""
    return (type(attn) is Attention and isinstance(attn.q_norm, nn.Identity)
            and isinstance(attn.k_norm, nn.Identity) and isinstance(attn.norm, nn.Identity)
            and getattr(attn, "gate", None) is None)


def uses_class_token(model: VisionTransformer) -> bool:
    """Whether the model's output is read from a class token (token 0) rather than pooled."""
    return getattr(model, "cls_token", None) is not None and getattr(model, "global_pool", "") == "token"
