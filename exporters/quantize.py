"""INT8 graphs: a float32 ONNX graph to its calibrated quantized (QDQ) form.

The quantizer is ONNX Runtime's ``quantize_static`` (no calibration math here): it runs the
float32 graph on calibration images, collects the range of every input of the quantized ops
with the chosen method (``minmax``, ``entropy`` or ``percentile``), and writes
QuantizeLinear/DequantizeLinear pairs on those inputs, the explicit-quantization form that ONNX
Runtime runs on CPU and GPU and TensorRT builds directly (strongly typed). Settings:

* the Linear layers (``MatMul`` / ``Gemm`` with a weight) are quantized: weights per output
  channel, their input activations per tensor;
* weights are signed int8 with symmetric ranges (zero point 0); so are the activations by
  default, which TensorRT requires for explicit quantization. ``activations="uint8"`` (CPU
  deployments) gives them unsigned int8 with asymmetric ranges instead, the form ONNX Runtime's
  x86 kernels prefer (U8S8): about 5 % faster on DeiT-B compressed at s = 0.5, batch 32
  (lab/RESULTS.md, "INT8: output rounding, smoothing, entropy");
* only their inputs are quantized, not their outputs (``quantize_static`` quantizes MatMul and
  Gemm outputs by default: one more int8 rounding of every Linear output, the model's own output
  included, before the bias and the residual add read it). Measured on the real DINOv2 ViT-S/14
  compressed at s = 0.5, every Linear in int8 (smoothed), against its fp32 graph on 64 held-out
  crops: with output Q/DQ cosine mean 0.9941 and min 0.9804, 1.71x faster than fp32 at batch 32;
  without, 0.9989 and 0.9968, 1.86x (ONNX Runtime then runs ``MatMulIntegerToFloat``, float out, instead of
  ``QLinearMatMul`` and a DequantizeLinear; lab/RESULTS.md "INT8");
* everything else stays float32: the two attention matmuls (``q k^T`` and ``softmax(.) v``,
  products of two activations), LayerNorm, softmax, GELU / SiLU, residual additions and the
  patch-embedding convolution (under 1 % of a ViT's MACs).

Measured on the real DINOv2 ViT-S/14 compressed at s = 0.3 (min cosine of int8 vs float32 on the
9 held-out parity images): with the attention matmuls in int8 too, 0.796 (minmax), 0.796
(entropy: then minmax under another name, see :data:`CALIBRATOR_OPTIONS`), 0.927 (percentile);
with them in float, 0.989 (minmax) and 0.928 (percentile), so minmax is the default. Ranges from
one constant grey image give 0.930, which the gate rejected (such images are now refused before
calibration: :class:`corp_deploy.calibration.ImageSpan`). Per-tensor activation ranges cannot
hold the outlier channels of the dense DINOv2 (min cosine 0.947 on the 9 images, below the gate;
mostly blocks 0-2 and the MLP down projections, lab/RESULTS.md "INT8"): ``input_scales``
moves them into the weights first (:mod:`exporters.smoothing`), and ``float_modules`` keeps chosen
Linear layers in float (which ones: :mod:`exporters.keep_float`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from corp_deploy import CorpError
from corp_deploy.resources import release_freed_memory

from .onnx_nodes import MATMUL_OPS, module_path
from .smoothing import smooth_graph

#: ``--int8-calibration`` values and ONNX Runtime's names for them.
CALIBRATION_METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile"}
DEFAULT_CALIBRATION = "minmax"
#: ``--int8-activations`` values: the Linear layers' inputs as signed int8 with symmetric ranges
#: (every runtime, TensorRT included) or unsigned int8 with asymmetric ranges (ONNX Runtime on x86).
ACTIVATION_TYPES = ("int8", "uint8")
DEFAULT_ACTIVATIONS = "int8"
#: Options of ONNX Runtime's calibrators. Its entropy defaults (128 histogram bins, 128 quantized
#: bins) leave the KL-divergence search a single candidate threshold, the full range, so ``entropy``
#: was ``minmax`` under another name whenever the histogram did not grow past its first 128 bins
#: (every tensor, when all images were collected at once). 2048 bins (TensorRT's entropy
#: calibrator's count) searched with 255 quantized bins (the symmetric int8 grid, -127..127) give
#: it 898 candidate thresholds; measured 0.6 s per tensor to search.
CALIBRATOR_OPTIONS = {"Entropy": {"num_bins": 2048, "num_quantized_bins": 255}}
#: Images per calibration run of ONNX Runtime. The calibration graph returns (entropy, percentile)
#: or holds (minmax) every Linear input of the images it runs at once, so this bounds its memory
#: whatever the number of calibration images. Measured on DeiT-B: 1 image per run is as fast as 4
#: (13.5 s and 14.0 s for 64 images) and needs 1.2 GB instead of 2.3 GB.
CALIBRATION_CHUNK = 1


def quantize_int8(
    fp32_path: str | Path,
    out_path: str | Path,
    batches: Iterable[np.ndarray],
    method: str = DEFAULT_CALIBRATION,
    float_modules: frozenset[str] | set[str] = frozenset(),
    input_scales: dict | None = None,
    quantize_outputs: bool = False,
    activations: str = DEFAULT_ACTIVATIONS,
) -> dict:
    """Write the QDQ int8 form of the float32 graph ``fp32_path`` to ``out_path``.

    Activation ranges are collected streaming (:func:`calibrate_ranges`) and handed to
    ``quantize_static`` through its calibration cache, so memory does not grow with the number of
    calibration images.

    Args:
        batches: preprocessed calibration images, each ``(B, C, H, W)`` float32.
        method: a key of :data:`CALIBRATION_METHODS`.
        float_modules: module paths (``blocks.3.mlp.fc2``) of Linear layers to keep in float; each
            must be found in the graph (:func:`exporters.onnx_nodes.module_path`) and is checked to be float afterwards.
        input_scales: per-channel smoothing scales by module path, moved from each Linear layer's
            input into its weight before calibration (:func:`exporters.smoothing.smooth_graph`).
        quantize_outputs: also round the Linear layers' outputs to int8 (``quantize_static``'s
            default; worse and slower, see the module docstring: for studies only).
        activations: a value of :data:`ACTIVATION_TYPES`.
    Returns:
        what was done, for the manifest: the method, the number of calibration images, the
        quantized op types and the op types left in float, the int8 weight count, the activations'
        type and, with ``input_scales``, how the smoothing was applied (``smoothing``).
    """
    if method not in CALIBRATION_METHODS:
        raise CorpError(f"int8 calibration must be one of {', '.join(CALIBRATION_METHODS)}; got {method!r}")
    if activations not in ACTIVATION_TYPES:
        raise CorpError(f"int8 activations must be one of {', '.join(ACTIVATION_TYPES)}; got {activations!r}")
    with tempfile.TemporaryDirectory(prefix="corp-deploy-int8-") as scratch:
        smoothing = {}
        if input_scales:
            smoothed = Path(scratch) / "smoothed.onnx"
            smoothing = {"smoothing": smooth_graph(fp32_path, smoothed, input_scales)}
            fp32_path = smoothed
            release_freed_memory()
        record = _quantize_static(
            fp32_path, out_path, batches, method, float_modules, Path(scratch), quantize_outputs, activations
        )
    return {**record, **smoothing}


def _quantize_static(
    fp32_path: Path,
    out_path: str | Path,
    batches: Iterable[np.ndarray],
    method: str,
    float_modules: frozenset[str] | set[str],
    scratch: Path,
    quantize_outputs: bool,
    activations: str,
) -> dict:
    """:func:`quantize_int8` of an already smoothed (or unsmoothed) graph; ``scratch`` a temporary folder."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.calibrate import save_tensors_data

    linear_ops = _linear_ops(fp32_path)
    # the attention matmuls (q k^T, softmax(.) v) multiply two activations: kept in float
    activation_products = [name for name, _, has_weight in linear_ops if not has_weight]
    kept_float = [name for name, module, _ in linear_ops if module in float_modules]
    missing = sorted(set(float_modules) - {module for _, module, _ in linear_ops})
    if missing:
        raise CorpError(
            f"cannot keep {', '.join(missing[:3])} in float: no operator of {Path(fp32_path).name} is "
            "recorded as coming from it"
        )
    calibrate_method = getattr(CalibrationMethod, CALIBRATION_METHODS[method])
    ranges, images = calibrate_ranges(fp32_path, batches, calibrate_method, scratch)
    release_freed_memory()
    cache, signed = scratch / "ranges.json", activations == "int8"
    save_tensors_data(ranges, cache)
    root_logger = logging.getLogger()
    root_logger.addFilter(_without_preprocessing_advice)
    try:
        quantize_static(
            str(fp32_path),
            str(out_path),
            None,
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QInt8 if signed else QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            per_channel=True,
            op_types_to_quantize=list(MATMUL_OPS),
            nodes_to_exclude=activation_products + kept_float,
            calibrate_method=calibrate_method,
            calibration_cache_path=cache,
            extra_options={
                "ActivationSymmetric": signed,
                "WeightSymmetric": True,
                "OpTypesToExcludeOutputQuantization": [] if quantize_outputs else list(MATMUL_OPS),
            },
        )
    finally:
        root_logger.removeFilter(_without_preprocessing_advice)
        release_freed_memory()
    described = describe_quantized(out_path)
    still_int8 = sorted(set(kept_float) - set(described.pop("float_nodes")))
    if still_int8:
        raise CorpError(f"the layers asked to stay in float were quantized anyway ({', '.join(still_int8[:3])})")
    return {"calibration": method, "calibration_images": images, "activations": activations, **described}


def _linear_ops(fp32_path: str | Path) -> list[tuple[str, str, bool]]:
    """``(node name, module path, has a weight)`` of every :data:`MATMUL_OPS` node of a graph
    (the graph itself is not kept: it holds every weight)."""
    import onnx

    graph = onnx.load(str(fp32_path), load_external_data=False).graph
    weights = {t.name for t in graph.initializer}
    return [
        (node.name, module_path(node), any(i in weights for i in node.input[:2]))
        for node in graph.node
        if node.op_type in MATMUL_OPS
    ]


def float_linear_layers(path: str | Path) -> list[str]:
    """The module paths of the layers with a weight that a QDQ graph computes in float (their weight
    is the graph's own float tensor, not dequantized from int8): what the graph itself says of an
    int8 export's ``kept_float`` record."""
    return [module for _, module, has_weight in _linear_ops(path) if has_weight]


def calibrate_ranges(fp32_path: str | Path, batches: Iterable[np.ndarray], calibrate_method, scratch: Path):
    """Activation ranges of the inputs of every :data:`MATMUL_OPS` node, with ONNX Runtime's own
    calibrator for ``calibrate_method``, fed :data:`CALIBRATION_CHUNK` images at a time: min/max
    ranges are merged and histograms accumulated after every chunk, so memory is that of one chunk.

    Returns ``(ranges, number of images)``; CorpError when there are no images."""
    from onnxruntime.quantization import CalibrationDataReader
    from onnxruntime.quantization.calibrate import create_calibrator

    class OneChunk(CalibrationDataReader):
        def __init__(self, feed: dict) -> None:
            self._feed = feed

        def get_next(self) -> dict | None:
            feed, self._feed = self._feed, None
            return feed

    calibrator = create_calibrator(
        Path(fp32_path),
        list(MATMUL_OPS),
        augmented_model_path=str(scratch / "augmented.onnx"),
        calibrate_method=calibrate_method,
        providers=["CPUExecutionProvider"],
        extra_options=CALIBRATOR_OPTIONS.get(calibrate_method.name, {}),
    )
    calibrator.model = None  # the loaded graph, not read after its session is made: one graph less in memory
    input_name = calibrator.infer_session.get_inputs()[0].name
    images = 0
    with contextlib.redirect_stdout(io.StringIO()):  # the histogram collector prints progress
        for batch in batches:
            batch = np.ascontiguousarray(batch, dtype=np.float32)
            for start in range(0, len(batch), CALIBRATION_CHUNK):
                calibrator.collect_data(OneChunk({input_name: batch[start : start + CALIBRATION_CHUNK]}))
            images += len(batch)
        if images == 0:
            raise CorpError("no calibration images for int8 quantization")
        ranges = calibrator.compute_data()
    return ranges, images


def _without_preprocessing_advice(record: logging.LogRecord) -> bool:
    """Drops ``quantize_static``'s advice to run ``quant_pre_process`` first (a root-logger
    warning, given twice per graph). Measured on the dense DINOv2 ViT-S/14: pre-processing left
    the int8 speed unchanged (1.04x, p10-p90 0.98-1.11) and its graph optimisation drops the
    nodes' module paths, so ``float_modules`` could no longer keep a layer in float."""
    return "pre-processing" not in record.getMessage()


def describe_quantized(path: str | Path) -> dict:
    """Which compute ops of a QDQ graph multiply int8 inputs (both operands dequantized from int8)
    and which compute in float, how many weights are stored as int8, and the names of the
    :data:`MATMUL_OPS` nodes left in float (``float_nodes``)."""
    import onnx

    graph = onnx.load(str(path)).graph
    produced_by_dq = {out for node in graph.node if node.op_type == "DequantizeLinear" for out in node.output}
    quantized, floating, float_nodes = Counter(), Counter(), []
    for node in graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") or node.op_type in _SHAPE_OPS:
            continue
        int8_inputs = node.op_type in MATMUL_OPS and all(i in produced_by_dq for i in node.input[:2])
        (quantized if int8_inputs else floating)[node.op_type] += 1
        if node.op_type in MATMUL_OPS and not int8_inputs:
            float_nodes.append(node.name)
    dequantized = {node.input[0] for node in graph.node if node.op_type == "DequantizeLinear"}
    int8 = [t for t in graph.initializer if t.data_type == onnx.TensorProto.INT8 and t.name in dequantized]
    return {
        "quantized_ops": dict(sorted(quantized.items())),
        "float_ops": dict(sorted(floating.items())),
        "int8_weights": int(sum(np.prod(t.dims) for t in int8)),
        "float_nodes": float_nodes,
    }


#: Ops that move or reshape data without arithmetic (not listed as float compute).
_SHAPE_OPS = frozenset(
    {
        "Reshape",
        "Transpose",
        "Shape",
        "Gather",
        "Slice",
        "Concat",
        "Squeeze",
        "Unsqueeze",
        "Expand",
        "Constant",
        "ConstantOfShape",
        "Identity",
        "Cast",
        "Flatten",
        "Split",
    }
)
