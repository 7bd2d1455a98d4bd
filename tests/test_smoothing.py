"""Outlier migration before int8 (exporters/smoothing.py) and the calibration methods reaching
ONNX Runtime's quantizer (exporters/quantize.py)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from exporters.keep_float import quantize_keeping_float
from exporters.onnx_export import export_onnx
from exporters.onnx_nodes import MATMUL_OPS, module_path
from exporters.parity import compare_outputs
from exporters.precision import PRECISIONS
from exporters.quantize import quantize_int8
from exporters.smoothing import SCALE_LIMIT, linear_input_peaks, linear_input_scales, smooth_graph, smoothing_scale


def _run(path, images: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"images": images})[0]


def _weighted_linear_nodes(path) -> tuple[dict, dict]:
    """``({module path: MatMul/Gemm node with a weight}, {initializer name: array})`` of a graph."""
    graph = onnx.load(str(path)).graph
    arrays = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    nodes = {module_path(n): n for n in graph.node if n.op_type in MATMUL_OPS and n.input[1] in arrays}
    return nodes, arrays


def test_input_peaks_and_scales_match_an_independent_computation(small_vit, image_batches):
    """The head's input peaks are the pooled features' per-channel max |x| (computed without hooks);
    every scale is peak^alpha / wpeak^(1-alpha), the largest allowed where the weight column is zero
    (an ignored input), 1 where the input never fired."""
    model = small_vit()
    batches = image_batches(2, 4)
    with torch.no_grad():
        features = torch.cat([model.forward_head(model.forward_features(b), pre_logits=True) for b in batches])
        model.head.weight[:, 5] = 0
    peaks = linear_input_peaks(model, batches)
    torch.testing.assert_close(peaks["head"], features.abs().amax(0), rtol=0, atol=0)
    scales = linear_input_scales(model, batches, alpha=0.3)
    expected = peaks["head"].double() ** 0.3 / model.head.weight.detach().abs().amax(0).double() ** 0.7
    expected[5] = SCALE_LIMIT
    torch.testing.assert_close(scales["head"].double(), expected, rtol=1e-6, atol=0)
    assert set(peaks) == {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    silent = smoothing_scale(torch.tensor([0.0, 2.0]), torch.ones(3, 2), alpha=0.5)
    assert silent.tolist() == [1.0, pytest.approx(2**0.5)]


def test_smoothed_graph_computes_what_the_float_graph_did(small_vit, image_batches, tmp_path):
    """Arbitrary positive scales on every Linear layer: the smoothed float graph's outputs equal the
    original's to float32 rounding; qkv and fc1 fold 1/s into their LayerNorm (no new op, also where
    the exporter shares one initializer between several ops), proj, fc2 (after a GELU in the form
    ONNX Runtime fuses, which a changed constant would break) and the head get a Mul; each changed
    weight is the PyTorch weight times s, each norm's scale and bias divided by s."""
    model = small_vit()
    with torch.no_grad():
        model.blocks[1].norm1.weight.uniform_(0.5, 1.5)  # its own initializer; block 0 shares all-ones
    export_onnx(model, tmp_path / "fp32.onnx", (3, 32, 32))
    generator = torch.Generator().manual_seed(3)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    scales = {name: torch.exp(torch.randn(m.in_features, generator=generator)) for name, m in linears.items()}
    counts = smooth_graph(tmp_path / "fp32.onnx", tmp_path / "smoothed.onnx", scales)
    assert counts == {"folded": 4, "inserted": 5}

    images = image_batches(1, 6)[0].numpy()
    before, after = _run(tmp_path / "fp32.onnx", images), _run(tmp_path / "smoothed.onnx", images)
    np.testing.assert_allclose(after, before, rtol=0, atol=1e-5 * np.abs(before).max())

    nodes, arrays = _weighted_linear_nodes(tmp_path / "smoothed.onnx")
    for name, linear in linears.items():
        node = nodes[name]
        transposed = any(a.name == "transB" and a.i for a in node.attribute)
        weight = arrays[node.input[1]] if transposed else arrays[node.input[1]].T
        np.testing.assert_allclose(weight, (linear.weight * scales[name]).detach().numpy(), rtol=1e-6, atol=1e-7)
    graph = onnx.load(str(tmp_path / "smoothed.onnx")).graph
    norms = [n for n in graph.node if n.op_type == "LayerNormalization"]
    for block, norm_name, consumer in ((0, "norm1", "attn.qkv"), (1, "norm1", "attn.qkv"), (1, "norm2", "mlp.fc1")):
        norm = getattr(model.blocks[block], norm_name)
        s = scales[f"blocks.{block}.{consumer}"].numpy()
        matches = [n for n in norms if np.allclose(arrays[n.input[2]], norm.bias.detach().numpy() / s, rtol=1e-6)]
        assert len(matches) == 1
        np.testing.assert_allclose(arrays[matches[0].input[1]], norm.weight.detach().numpy() / s, rtol=1e-6)
    assert sum(n.op_type == "Mul" and n.name.endswith("/smoothing") for n in graph.node) == 5


def _plant_used_outliers(model: torch.nn.Module, factor: float = 1000.0) -> None:
    """Channel 0 of the final norm's output (the head's input) and of block 0's norm2 (fc1's input)
    scaled ``factor``-fold, and the layers reading them scaled back (weight column / ``factor``): the
    same function, with outlier channels that a per-tensor int8 range must cover (as real DINOv2)."""
    with torch.no_grad():
        for norm, linear in ((model.norm, model.head), (model.blocks[0].norm2, model.blocks[0].mlp.fc1)):
            norm.weight[0] *= factor
            norm.bias[0] *= factor
            linear.weight[:, 0] /= factor


def test_smoothing_lets_int8_hold_an_outlier_channel(small_vit, image_batches, tmp_path):
    """With outlier channels before the head and a fc1, every Linear in int8: without smoothing the
    graph misses the gate's 0.98 min cosine against float on held-out images; with the default
    smoothing it meets it, with no layer kept in float, and the record says how each layer was
    smoothed (qkv and fc1 folded, proj, fc2 and the head by a Mul)."""
    model = small_vit()
    _plant_used_outliers(model)
    export_onnx(model, tmp_path / "fp32.onnx", (3, 32, 32))
    calibration, held_out = image_batches(4, 8, seed=1), image_batches(2, 8, seed=2)
    tolerance = PRECISIONS["int8"].tolerance
    with torch.no_grad():
        reference = torch.cat([model(b) for b in held_out]).numpy()
    cosines = {}
    for alpha in (None, 0.5):
        int8 = quantize_keeping_float(
            model,
            tmp_path / "fp32.onnx",
            tmp_path / f"{alpha}.onnx",
            calibration,
            0,
            "minmax",
            tolerance,
            smoothing=alpha,
        )
        assert int8["kept_float"] == [] and int8["smoothing_alpha"] == alpha
        assert int8.get("smoothing") == (None if alpha is None else {"folded": 4, "inserted": 5})
        outputs = np.concatenate([_run(tmp_path / f"{alpha}.onnx", b.numpy()) for b in held_out])
        cosines[alpha] = compare_outputs(reference, outputs, top1=False).cosine
    assert cosines[None] < 0.98 <= cosines[0.5], cosines


def _activation_scales(path) -> dict[str, float]:
    """The int8 scale of each quantized Linear layer's input in a QDQ graph, by module path."""
    graph = onnx.load(str(path)).graph
    arrays = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    dequantized = {n.output[0]: n for n in graph.node if n.op_type == "DequantizeLinear"}
    return {
        module_path(n): float(arrays[dequantized[n.input[0]].input[1]])
        for n in graph.node
        if n.op_type in MATMUL_OPS and n.input[0] in dequantized and n.input[1] in dequantized
    }


def test_each_calibration_method_reaches_the_quantizer(small_vit, image_batches, tmp_path):
    """minmax sets each Linear input's int8 scale to its largest |x| on the calibration images / 127
    (the peaks computed with PyTorch); entropy (KL-divergence threshold search) clips the tails, so
    every scale is smaller (with ONNX Runtime's default 128 bins it had one candidate, the full
    range, and gave minmax's scales); percentile (99.999 % of |x|) never exceeds minmax and clips
    where the tail is long."""
    model = small_vit()
    export_onnx(model, tmp_path / "fp32.onnx", (3, 32, 32))
    calibration = image_batches(4, 8, seed=1)
    scales = {}
    for method in ("minmax", "entropy", "percentile"):
        quantize_int8(tmp_path / "fp32.onnx", tmp_path / f"{method}.onnx", (b.numpy() for b in calibration), method)
        scales[method] = _activation_scales(tmp_path / f"{method}.onnx")
    peaks = linear_input_peaks(model, calibration)
    assert set(scales["minmax"]) == set(peaks)
    ratios = {
        method: np.array([scales[method][name] / scales["minmax"][name] for name in peaks])
        for method in ("entropy", "percentile")
    }
    for name, peak in peaks.items():
        assert scales["minmax"][name] == pytest.approx(float(peak.max()) / 127, rel=1e-5)
    assert ratios["entropy"].max() < 0.999 and np.median(ratios["entropy"]) < 0.99, ratios["entropy"]
    assert ratios["percentile"].max() <= 1 + 1e-6 and ratios["percentile"].min() < 0.99, ratios["percentile"]


class _ScaledInputs(torch.nn.Module):
    """Three Linear layers behind constant factors on ``C x C`` inputs: ``per_token`` has shape
    ``(C, 1)`` (one value per row, the same size as a per-channel vector) and must not be folded;
    ``per_channel`` has shape ``(1, 1, C)`` (rank above its input's) and folds, keeping its rank;
    the scalar 0.5 folds and becomes a ``(C,)`` vector."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.per_token = torch.nn.Parameter(torch.rand(channels, 1) + 0.5)
        self.per_channel = torch.nn.Parameter(torch.rand(1, 1, channels) + 0.5)
        self.rows, self.pooled = torch.nn.Linear(channels, 8), torch.nn.Linear(channels, 8)
        self.halved = torch.nn.Linear(channels, 8)

    def forward(self, images):  # (B, 1, C, C)
        x = images.flatten(1, 2)
        pooled = x.mean(1)
        return (
            self.rows(x * self.per_token).mean(1)
            + self.pooled(pooled * self.per_channel)[0]
            + self.halved(pooled.square() * 0.5)
        )


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_only_constants_of_one_value_per_channel_take_the_division(exporter, tmp_path):
    """A constant the size of a per-channel vector but laid along the rows gets a Mul, not a fold;
    a per-channel constant of higher rank than its input folds and the output keeps its shape, and
    so does a scalar initializer."""
    model = _ScaledInputs().eval()
    export_onnx(model, tmp_path / "fp32.onnx", (1, 16, 16), exporter=exporter)
    generator = torch.Generator().manual_seed(5)
    scales = {name: torch.exp(2 * torch.randn(16, generator=generator)) for name in ("rows", "pooled", "halved")}
    scalar_folded = exporter == "dynamo"  # the TorchScript exporter writes the 0.5 as a Constant node: a Mul
    assert smooth_graph(tmp_path / "fp32.onnx", tmp_path / "smoothed.onnx", scales) == {
        "folded": 1 + scalar_folded,
        "inserted": 2 - scalar_folded,
    }
    images = torch.randn(3, 1, 16, 16, generator=generator).numpy()
    before, after = _run(tmp_path / "fp32.onnx", images), _run(tmp_path / "smoothed.onnx", images)
    assert after.shape == before.shape
    np.testing.assert_allclose(after, before, rtol=0, atol=1e-5 * np.abs(before).max())


def test_a_scalar_rewritten_in_place_keeps_the_graph_quantizable(tmp_path):
    """A private scalar constant (``0.5`` before ``halved``) rewritten in place as a per-channel
    vector: the graph's shapes stay consistent for the quantizer's own shape inference (it failed
    there once: the old scalar shape was kept), and the int8 graph runs."""
    model = _ScaledInputs().eval()
    export_onnx(model, tmp_path / "fp32.onnx", (1, 16, 16))
    generator = torch.Generator().manual_seed(6)
    calibration = [torch.randn(4, 1, 16, 16, generator=generator) for _ in range(2)]
    scales = {name: torch.exp(torch.randn(16, generator=generator)) for name in ("rows", "pooled", "halved")}
    int8 = quantize_int8(
        tmp_path / "fp32.onnx", tmp_path / "int8.onnx", (b.numpy() for b in calibration), input_scales=scales
    )
    assert int8["smoothing"] == {"folded": 2, "inserted": 1}
    onnx.checker.check_model(str(tmp_path / "int8.onnx"))
    assert _run(tmp_path / "int8.onnx", calibration[0].numpy()).shape == (4, 8)
