"""Outlier migration before int8 (SmoothQuant's idea): per-channel scales moved from a Linear
layer's input into its weight, exact in float.

A Linear layer ``y = x W^T + b`` computes the same with its input divided and its weight's
columns multiplied by any positive per-input-channel scale ``s``: ``y = (x / s) (W diag(s))^T + b``.
A per-tensor int8 range for ``x`` must cover its largest channel, so a few outlier channels crush
the resolution of all the others; ``x / s`` with ``s_j = peak_j^alpha / wpeak_j^(1 - alpha)``
(``peak_j`` = the largest ``|x_j|`` on the calibration images, ``wpeak_j`` = the largest
``|W_ij|`` over outputs ``i``) flattens the channels, and the weight, rounded per output channel,
absorbs the scale. ``alpha`` trades the input's range against the weight's (0.5 balances them).

:func:`linear_input_scales` chooses the scales on the PyTorch model; :func:`smooth_graph` applies
them to its float32 ONNX graph: where the op that makes the layer's input can take the division
exactly and feeds nothing else, ``1 / s`` is folded into it (a LayerNormalization's scale and
bias, a constant factor of a chain of Muls: no new op), otherwise a ``Mul`` by ``1 / s`` is
inserted before the layer (an attention output, pooled features, and a GELU in the form ONNX
Runtime fuses, :mod:`exporters.fusable_forms`, whose constant 0.5 must stay 0.5 to be fused).
Either way the float graph computes what it did, up to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .fusable_forms import is_fusable_gelu, scalar_initializers
from .onnx_nodes import MATMUL_OPS, module_path

DEFAULT_ALPHA = 0.5
#: Scales are kept within this factor of 1 either way (channels that never fire, dead weights).
SCALE_LIMIT = 1e4


def linear_input_peaks(model: nn.Module, batches: Iterable[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The largest ``|x_j|`` per input channel ``j`` of every Linear layer of ``model`` over the
    images of ``batches`` (each ``(B, C, H, W)``): ``{module path: (in_features,) float32}``."""
    linears = {module: name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    peaks: dict[str, torch.Tensor] = {}

    def record(module, args):
        name = linears[module]
        x = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()
        peaks[name] = torch.maximum(peaks[name], x) if name in peaks else x

    handles = [module.register_forward_pre_hook(record) for module in linears]
    try:
        with torch.no_grad():
            for batch in batches:
                model(batch)
    finally:
        for handle in handles:
            handle.remove()
    return peaks


def smoothing_scale(peak: torch.Tensor, weight: torch.Tensor, alpha: float = DEFAULT_ALPHA) -> torch.Tensor:
    """``s_j = peak_j^alpha / wpeak_j^(1 - alpha)`` for a Linear layer's ``(out, in)`` ``weight`` and
    its input's per-channel ``peak`` ``(in,)``, limited to ``[1 / SCALE_LIMIT, SCALE_LIMIT]``: very
    large where the weight column is all zero (the layer ignores that input, which then cannot
    stretch the range; up to the limit unless alpha is near 1), 1 where the input was zero on every
    calibration image."""
    weight_peak = weight.detach().abs().amax(0).float()
    scale = peak.clamp_min(1e-30).pow(alpha) / weight_peak.clamp_min(1e-30).pow(1 - alpha)
    return torch.where(peak > 0, scale.clamp(1 / SCALE_LIMIT, SCALE_LIMIT), torch.ones_like(scale))


def linear_input_scales(
    model: nn.Module, batches: Iterable[torch.Tensor], alpha: float = DEFAULT_ALPHA
) -> dict[str, torch.Tensor]:
    """:func:`smoothing_scale` of every Linear layer of ``model`` from its input peaks on ``batches``:
    ``{module path: (in_features,) float32}``."""
    modules = dict(model.named_modules())
    return {
        name: smoothing_scale(peak, modules[name].weight, alpha)
        for name, peak in linear_input_peaks(model, batches).items()
    }


def smooth_graph(
    fp32_path: str | Path, out_path: str | Path, scales: dict[str, np.ndarray | torch.Tensor]
) -> dict[str, int]:
    """Write ``fp32_path`` to ``out_path`` with each scale of ``scales`` (by module path, see
    :func:`exporters.onnx_nodes.module_path`) moved from its Linear layer's input into its weight.

    A layer is smoothed when its ``MatMul`` / ``Gemm`` node takes the activation first and an
    initializer of ``(in, out)`` (``MatMul``, ``Gemm`` without ``transB``) or ``(out, in)``
    (``Gemm`` with ``transB``) second; other nodes are left as they are. Initializers that other
    nodes share are copied before they change.
    Returns ``{"folded": MatMul/Gemm nodes whose 1/s went into the op that makes their input,
    "inserted": nodes given a Mul}``. The written graph's shapes are inferred again (strict).
    """
    import onnx

    model, counts = _smoothed_model(fp32_path, scales)
    onnx.save_model(model, str(out_path))
    del model  # before the shape inference loads the written graph: one graph in memory at a time
    onnx.shape_inference.infer_shapes_path(str(out_path), str(out_path), check_type=True, strict_mode=True)
    return counts


def _smoothed_model(fp32_path: str | Path, scales: dict[str, np.ndarray | torch.Tensor]):
    """:func:`smooth_graph`'s rewrite, in memory: ``(the smoothed ModelProto, counts)``."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(fp32_path))
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    constants = scalar_initializers(graph)
    nodes = [onnx.NodeProto.FromString(node.SerializeToString()) for node in graph.node]
    readers: dict[str, list] = {}
    for node in nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    producers = {out: node for node in nodes for out in node.output}
    graph_outputs = {o.name for o in graph.output}

    def read(name: str) -> np.ndarray:
        return numpy_helper.to_array(initializers[name]).astype(np.float64)

    def replace_input(node, index: int, array: np.ndarray) -> None:
        """Give ``node`` ``array`` as its ``index``-th input: in place where nothing else reads
        that initializer, else as a new one (the exporters share identical tensors between nodes)."""
        name = node.input[index]
        tensor = numpy_helper.from_array(array.astype(np.float32), name)
        if len(readers[name]) == 1:
            initializers[name].CopyFrom(tensor)
            return
        tensor.name = f"{node.name}/smoothed_input_{index}"
        graph.initializer.append(tensor)
        node.input[index] = tensor.name

    def divide_at_source(tensor: str, scale: np.ndarray) -> bool:
        """Divide ``tensor`` by ``scale`` along its last axis by changing what makes it, where that
        is exact and changes nothing else: a LayerNormalization's scale and bias, or a constant
        factor anywhere up a chain of Muls that only feed each other (not a fusable GELU's 0.5).
        Broadcasting aligns every operand's last axis with the product's, so a constant that is
        one value or one per last-axis channel (shape ``(1, ..., 1, 1 or C)``) takes the division,
        keeping its rank. False where no such op makes it."""
        node = producers.get(tensor)
        if node is None or len(readers[tensor]) != 1 or tensor in graph_outputs or node.output[0] != tensor:
            return False
        if node.op_type == "LayerNormalization":
            if not all(i in initializers for i in node.input[1:] if i):
                return False
            for index, parameter in enumerate(node.input[1:], start=1):
                if parameter:
                    replace_input(node, index, read(parameter) / scale)
            return True
        if node.op_type != "Mul" or is_fusable_gelu(node, producers, constants):
            return False  # not a Mul, or a GELU's last one: a constant changed there stops ONNX Runtime fusing it
        for index, operand in enumerate(node.input):
            if operand in initializers and _per_channel(read(operand).shape, scale.size):
                constant = read(operand)
                replace_input(node, index, constant.reshape(constant.shape[:-1] + (-1,)) / scale)
                return True
        return any(divide_at_source(operand, scale) for operand in node.input if operand not in initializers)

    counts = {"folded": 0, "inserted": 0}
    ordered = []  # the new node list: a Mul goes right before the layer it feeds
    for node in nodes:
        ordered.append(node)
        name = module_path(node)
        if node.op_type not in MATMUL_OPS or name not in scales or len(node.input) < 2:
            continue
        activation, weight_name = node.input[0], node.input[1]
        if weight_name not in initializers:
            continue
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if attributes.get("transA", 0):
            continue
        scale = np.asarray(scales[name], dtype=np.float64)
        weight = read(weight_name)
        in_axis = 1 if attributes.get("transB", 0) else 0
        if weight.ndim != 2 or weight.shape[in_axis] != scale.size:
            continue
        replace_input(node, 1, weight * (scale[None, :] if in_axis else scale[:, None]))
        if divide_at_source(activation, scale):
            counts["folded"] += 1
            continue
        inverse = f"{node.name or weight_name}/smoothing_inverse_scale"
        smoothed = f"{node.name or weight_name}/smoothed_input"
        graph.initializer.append(numpy_helper.from_array((1 / scale).astype(np.float32), inverse))
        mul = onnx.helper.make_node("Mul", [activation, inverse], [smoothed], name=f"{node.name}/smoothing")
        mul.metadata_props.extend(node.metadata_props)
        ordered.insert(len(ordered) - 1, mul)
        node.input[0] = smoothed
        counts["inserted"] += 1
    graph.ClearField("node")
    graph.node.extend(ordered)
    graph.ClearField("value_info")  # constants and products along a Mul chain may have changed shape
    still_read = {name for node in ordered for name in node.input}
    orphans = [t for t in graph.initializer if t.name in readers and t.name not in still_read]  # all readers got copies
    for tensor in orphans:
        graph.initializer.remove(tensor)
    return model, counts


def _per_channel(shape: tuple[int, ...], channels: int) -> bool:
    """Whether a constant of ``shape`` is one value or one per channel of a last axis of
    ``channels``: ``()`` or ``(1, ..., 1, 1 or channels)``."""
    return all(size == 1 for size in shape[:-1]) and shape[-1:] in ((), (1,), (channels,))
