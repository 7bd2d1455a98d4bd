"""ONNX export of dense and compressed ViTs: graph shape, ONNX Runtime parity, precisions, large files."""

from dataclasses import replace

import numpy as np
import onnx
import pytest
import torch

from corp_deploy import CompressConfig, compress
from exporters.onnx_export import export_onnx
from exporters.parity import Comparison, compare_outputs
from exporters.precision import PRECISIONS
from exporters.runners import BackendUnavailable, OnnxRuntimeRunner

SIZE = (3, 32, 32)


@pytest.fixture(scope="module")
def pruned(small_vit, image_batches):
    """The small ViT with MLP and query/key dims pruned by half (q/k head dim 8 != v head dim 16)."""
    model, _ = compress(small_vit(), image_batches(2, 4), CompressConfig(s_mlp=0.5, s_attn=0.5))
    return model


@pytest.fixture
def ort_parity(image_batches):
    """``ort_parity(model, path, batch)``: ONNX Runtime's outputs of the graph at ``path`` against
    ``model``'s on ``batch`` random images (:func:`compare_outputs`)."""

    def parity(model, path, batch, seed=7):
        x = image_batches(1, batch, seed=seed)[0]
        with torch.no_grad():
            ref = model(x).numpy()
        return compare_outputs(ref, OnnxRuntimeRunner(path).infer(x.numpy()))

    return parity


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("compressed", [False, True])
def test_runtime_parity_at_batch_sizes_other_than_traced(tmp_path, pruned, exporter, compressed, small_vit, ort_parity):
    model = pruned if compressed else small_vit()
    info = export_onnx(model, tmp_path / "m.onnx", SIZE, exporter=exporter, trace_batch=2)
    assert info["files"] == ["m.onnx"] and [p.name for p in tmp_path.iterdir()] == ["m.onnx"]
    assert info["inputs"] == [{"name": "images", "shape": ["batch", 3, 32, 32], "dtype": "float32"}]
    assert info["outputs"] == [{"name": "outputs", "shape": ["batch", 1000], "dtype": "float32"}]
    for batch in (1, 5):
        result = ort_parity(model, tmp_path / "m.onnx", batch)
        assert result.max_abs < 1e-4 and result.top1_agreement == 1.0, result


def value_shapes(path):
    """Every tensor's inferred shape in the saved graph (export runs shape inference)."""
    graph = onnx.load(str(path)).graph
    return {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in [*graph.value_info, *graph.input, *graph.output]
    }, graph


def test_pruned_attention_exports_as_plain_matmul_softmax_with_unequal_head_dims(tmp_path, pruned, ort_parity):
    """q/k head dim 8, v head dim 16: the graph must carry both, without a fused Attention op,
    so that ONNX Runtime and TensorRT run it; the logits use the ORIGINAL scale 16**-0.5."""
    export_onnx(pruned, tmp_path / "m.onnx", SIZE)
    shapes, graph = value_shapes(tmp_path / "m.onnx")
    ops = [n.op_type for n in graph.node]
    assert "Attention" not in ops and ops.count("Softmax") == 2
    producers = {out: n for n in graph.node for out in n.output}
    for softmax in (n for n in graph.node if n.op_type == "Softmax"):
        node = producers[softmax.input[0]]
        while node.op_type != "MatMul":  # past the scale multiplication, if it comes after
            node = producers[node.input[0]]
        q, k_t = (shapes[name] for name in node.input)
        assert q[1:] == [3, 17, 8] and k_t[1:] == [3, 8, 17], (q, k_t)  # heads, tokens, q/k dim 8
        consumer = next(n for n in graph.node if softmax.output[0] in n.input)
        assert consumer.op_type == "MatMul" and shapes[consumer.input[1]][1:] == [3, 17, 16]  # v dim 16
    # The scale is the original one: scaling by 8**-0.5 instead would break parity.
    assert ort_parity(pruned, tmp_path / "m.onnx", 3).max_abs < 1e-4


def test_weights_beyond_the_single_file_limit_go_to_one_external_file(tmp_path, pruned, ort_parity):
    info = export_onnx(pruned, tmp_path / "m.onnx", SIZE, single_file_limit=10_000)
    assert info["files"] == ["m.onnx", "m.onnx.data"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]
    graph = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False).graph
    external = [t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert {e.value for t in external for e in t.external_data if e.key == "location"} == {"m.onnx.data"}
    assert all(t.ByteSize() < 1024 for t in graph.initializer if t not in external)
    assert (
        sum(int(e.value) for t in external for e in t.external_data if e.key == "length")
        == (tmp_path / "m.onnx.data").stat().st_size
    )
    assert ort_parity(pruned, tmp_path / "m.onnx", 2).max_abs < 1e-4


def test_fp16_keeps_layernorm_and_softmax_in_fp32_and_stays_close(tmp_path, pruned, ort_parity):
    info = export_onnx(pruned, tmp_path / "m.onnx", SIZE, precision="fp16")
    assert info["inputs"][0]["dtype"] == info["outputs"][0]["dtype"] == "float32"
    graph = onnx.load(str(tmp_path / "m.onnx")).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
    types.update({t.name: t.data_type for t in graph.initializer})
    float32, float16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    for node in graph.node:
        if node.op_type in ("LayerNormalization", "Softmax", "Conv"):
            assert types[node.input[0]] == float32 and types[node.output[0]] == float32, node.name
        if node.op_type in ("MatMul", "Gemm"):
            assert all(types[i] == float16 for i in node.input), node.name
    assert sum(n.op_type == "LayerNormalization" for n in graph.node) == 5  # 2 blocks x 2 + final
    result = ort_parity(pruned, tmp_path / "m.onnx", 5)
    assert not PRECISIONS["fp16"].tolerance.violations(result), result
    assert result.max_abs > 1e-6  # it really computed in fp16


def test_bf16_graph_is_valid_onnx_but_onnxruntime_cpu_cannot_run_it(tmp_path, pruned):
    export_onnx(pruned, tmp_path / "m.onnx", SIZE, precision="bf16")
    graph = onnx.load(str(tmp_path / "m.onnx")).graph
    assert onnx.TensorProto.BFLOAT16 in {t.data_type for t in graph.initializer}
    with pytest.raises(BackendUnavailable, match="cannot run m.onnx"):
        OnnxRuntimeRunner(tmp_path / "m.onnx", "cpu")


def test_failed_export_leaves_nothing(tmp_path):
    class Broken(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("cannot trace")

    with pytest.raises(Exception, match="cannot trace"):
        export_onnx(Broken(), tmp_path / "m.onnx", (3, 8, 8), exporter="torchscript")
    assert list(tmp_path.iterdir()) == []


def test_compare_outputs_on_known_inputs():
    a = np.array([[1.0, 2.0, 3.0], [3.0, 1.0, 0.0]])
    same = compare_outputs(a, a.copy())
    assert same.to_dict() == {"max_abs": 0.0, "max_rel": 0.0, "cosine": pytest.approx(1.0), "top1_agreement": 1.0}
    b = np.array([[1.0, 2.0, 3.5], [0.0, 1.0, 0.0]])
    diff = compare_outputs(a, b)
    assert diff.max_abs == 3.0 and diff.top1_agreement == 0.5
    assert diff.cosine == pytest.approx(1 / np.sqrt(10))
    assert diff.max_rel == pytest.approx(1.0)
    assert compare_outputs(a, b, top1=False).top1_agreement is None


def test_tolerance_names_each_violation():
    result = Comparison(max_abs=2e-3, max_rel=0.1, cosine=0.998, top1_agreement=0.5)
    assert PRECISIONS["fp32"].tolerance.violations(result) == [
        "max abs error 0.002 > atol 0.0001",
        "cosine 0.998000 < 0.99999",
    ]
    assert PRECISIONS["fp16"].tolerance.violations(result) == [
        "cosine 0.998000 < 0.999",
        "top-1 agreement 0.500000 < 0.85",
    ]
    assert PRECISIONS["fp16"].tolerance.with_limits(atol=1e-2, min_cosine=0.99).violations(result) == [
        "top-1 agreement 0.500000 < 0.85"
    ]
    assert PRECISIONS["bf16"].tolerance.violations(replace(result, top1_agreement=None)) == []
    just_below = replace(result, cosine=0.99999999)  # as many digits as show it below the limit
    assert PRECISIONS["fp32"].tolerance.with_limits(min_cosine=1.0).violations(just_below)[1] == "cosine 0.99999999 < 1"
    exact = PRECISIONS["fp32"].tolerance.with_limits(min_cosine=1.0, min_top1=1.0)
    almost_all = replace(just_below, top1_agreement=999 / 1000)
    assert exact.violations(almost_all)[1:] == ["cosine 0.99999999 < 1", "top-1 agreement 0.999000 < 1"]
    assert exact.measured(almost_all) == "max_abs=0.002, max_rel=0.1, cosine=0.99999999, top1_agreement=0.999000"
    assert exact.measured(replace(almost_all, top1_agreement=None)).endswith(", cosine=0.99999999")
    atol_only = PRECISIONS["int8"].tolerance.with_limits(atol=0.0)  # the cosine passes its limit, yet is not 1
    measured = atol_only.measured(replace(result, cosine=0.9995461))
    assert measured.startswith("max_abs=0.002, max_rel=0.1, cosine=0.999546,")
    close = replace(result, cosine=0.99999999999996)
    assert exact.with_limits(min_cosine=0.99999999999999).violations(close)[1] == (
        "cosine 0.99999999999996 < 0.99999999999999"
    )
