"""INT8 graphs: a float32 ONNX graph to its calibrated quantized (QDQ) form.

The quantizer is ONNX Runtime's ``quantize_static`` (no calibration math here): it runs the
float32 graph on calibration images, collects the range of every input of the quantized ops
with the chosen method (``minmax``, ``entropy`` or ``percentile``), and writes
QuantizeLinear/DequantizeLinear pairs around them, the explicit-quantization form that ONNX
Runtime runs on CPU and GPU and TensorRT builds directly (strongly typed). Settings:

* the Linear layers (``MatMul`` / ``Gemm`` with a weight) are quantized: weights per output
  channel, their input activations per tensor;
* weights and activations are signed int8 with symmetric ranges (zero point 0), which TensorRT
  requires for explicit quantization;
* everything else stays float32: the two attention matmuls (``q k^T`` and ``softmax(.) v``,
  products of two activations), LayerNorm, softmax, GELU / SiLU, residual additions and the
  patch-embedding convolution (under 1 % of a ViT's MACs).

Measured on the real DINOv2 ViT-S/14 compressed at s = 0.3 (min cosine of int8 vs float32 on the
9 held-out parity images): with the attention matmuls in int8 too, 0.796 (minmax), 0.796
(entropy), 0.927 (percentile); with them in float, 0.989 (minmax) and 0.928 (percentile), so
minmax is the default. Ranges from one constant grey image give 0.930, which the gate rejects.
The dense DINOv2 ViT-S/14 does worse with this recipe (min cosine 0.947 on the 9 images, below
the gate): per-tensor activation ranges cannot hold its outlier activations, mostly in blocks 0-2
(benchmarks/RESULTS.md, "INT8"). ``float_modules`` keeps chosen Linear layers in float; which
ones is decided in :mod:`exporters.keep_float`.
"""
from __future__ import annotations

import ast
import logging
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from corp_deploy import CorpError

#: ``--int8-calibration`` values and ONNX Runtime's names for them.
CALIBRATION_METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile"}
DEFAULT_CALIBRATION = "minmax"
#: Operators whose inputs become int8.
QUANTIZED_OPS = ("MatMul", "Gemm")


def quantize_int8(fp32_path: str | Path, out_path: str | Path, batches: Iterable[np.ndarray],
                  method: str = DEFAULT_CALIBRATION, float_modules: Callable[[str], bool] = lambda path: False
                  ) -> dict:
    """Write the QDQ int8 form of the float32 graph ``fp32_path`` to ``out_path``.

    Args:
        batches: preprocessed calibration images, each ``(B, C, H, W)`` float32.
        method: a key of :data:`CALIBRATION_METHODS`.
        float_modules: True for the module paths (``blocks.3.mlp.fc2``) of Linear layers to keep
            in float (read from the exporter's ``name_scopes`` metadata).
    Returns:
        what was done, for the manifest: the method, the number of calibration images, the
        quantized op types and the op types left in float, and the int8 weight count.
    """
    import onnx
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)

    if method not in CALIBRATION_METHODS:
        raise CorpError(f"int8 calibration must be one of {', '.join(CALIBRATION_METHODS)}; got {method!r}")
    graph = onnx.load(str(fp32_path), load_external_data=False).graph
    input_name = graph.input[0].name
    weights = {t.name for t in graph.initializer}
    # the attention matmuls (q k^T, softmax(.) v) multiply two activations: kept in float
    activation_products = [node.name for node in graph.node
                           if node.op_type in QUANTIZED_OPS and not any(i in weights for i in node.input[:2])]
    kept_float = [node.name for node in graph.node
                  if node.op_type in QUANTIZED_OPS and float_modules(module_path(node))]
    images = 0

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._batches = iter(batches)

        def get_next(self) -> dict | None:
            nonlocal images
            batch = next(self._batches, None)
            if batch is None:
                return None
            images += len(batch)
            return {input_name: np.ascontiguousarray(batch, dtype=np.float32)}

    root_logger = logging.getLogger()
    root_logger.addFilter(_without_preprocessing_advice)
    try:
        quantize_static(str(fp32_path), str(out_path), Reader(), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, per_channel=True,
                        op_types_to_quantize=list(QUANTIZED_OPS), nodes_to_exclude=activation_products + kept_float,
                        calibrate_method=getattr(CalibrationMethod, CALIBRATION_METHODS[method]),
                        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
    finally:
        root_logger.removeFilter(_without_preprocessing_advice)
    if images == 0:
        raise CorpError("no calibration images for int8 quantization")
    return {"calibration": method, "calibration_images": images, **describe_quantized(out_path)}


def _without_preprocessing_advice(record: logging.LogRecord) -> bool:
    """Drops ``quantize_static``'s advice to run ``quant_pre_process`` first (a root-logger
    warning, given twice per graph). Measured on the dense DINOv2 ViT-S/14: pre-processing left
    the int8 speed unchanged (1.04x, p10-p90 0.98-1.11) and its graph optimisation drops the
    nodes' module paths, so ``float_modules`` could no longer keep a layer in float."""
    return "pre-processing" not in record.getMessage()


def module_path(node) -> str:
    """The PyTorch module an ONNX node was exported from (``blocks.0.attn.qkv``), from the torch
    exporter's ``pkg.torch.onnx.name_scopes`` metadata; empty when it has none."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            scopes = ast.literal_eval(prop.value)
            return scopes[-2] if len(scopes) > 1 else ""
    return ""


def describe_quantized(path: str | Path) -> dict:
    """Which compute ops of a QDQ graph multiply int8 inputs (both operands dequantized from int8)
    and which compute in float, and how many weights are stored as int8."""
    import onnx

    graph = onnx.load(str(path)).graph
    produced_by_dq = {out for node in graph.node if node.op_type == "DequantizeLinear" for out in node.output}
    quantized, floating = Counter(), Counter()
    for node in graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") or node.op_type in _SHAPE_OPS:
            continue
        int8_inputs = node.op_type in QUANTIZED_OPS and all(i in produced_by_dq for i in node.input[:2])
        (quantized if int8_inputs else floating)[node.op_type] += 1
    dequantized = {node.input[0] for node in graph.node if node.op_type == "DequantizeLinear"}
    int8 = [t for t in graph.initializer if t.data_type == onnx.TensorProto.INT8 and t.name in dequantized]
    return {"quantized_ops": dict(sorted(quantized.items())), "float_ops": dict(sorted(floating.items())),
            "int8_weights": int(sum(np.prod(t.dims) for t in int8))}


#: Ops that move or reshape data without arithmetic (not listed as float compute).
_SHAPE_OPS = frozenset({"Reshape", "Transpose", "Shape", "Gather", "Slice", "Concat", "Squeeze", "Unsqueeze",
                        "Expand", "Constant", "ConstantOfShape", "Identity", "Cast", "Flatten", "Split"})
