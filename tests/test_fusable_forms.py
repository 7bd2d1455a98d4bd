"""Exported GELUs rewritten into the form ONNX Runtime fuses (exporters/fusable_forms.py)."""

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from exporters.fusable_forms import rewrite_gelu
from exporters.onnx_export import export_onnx


def _gelu_graph(half: float = 0.5, divisor: float = 2**0.5) -> onnx.ModelProto:
    """``y = x * ((erf(x / divisor) + 1) * half)`` on a ``(N, 8)`` input: the dynamo exporter's GELU
    when ``half`` and ``divisor`` are 0.5 and sqrt 2."""
    nodes = [
        helper.make_node("Div", ["x", "divisor"], ["scaled"]),
        helper.make_node("Erf", ["scaled"], ["erf"]),
        helper.make_node("Add", ["erf", "one"], ["plus_one"]),
        helper.make_node("Mul", ["plus_one", "half"], ["halved"]),
        helper.make_node("Mul", ["x", "halved"], ["y"]),
    ]
    constants = [
        numpy_helper.from_array(np.array(v, np.float32), name)
        for name, v in (("divisor", divisor), ("one", 1.0), ("half", half))
    ]
    graph = helper.make_graph(
        nodes,
        "gelu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])],
        constants,
    )
    imports = [helper.make_opsetid("", 18)]
    return helper.make_model(graph, opset_imports=imports, ir_version=helper.find_min_ir_version_for(imports))


def _optimized_ops(model: onnx.ModelProto, path) -> Counter:
    """The op types of ``model`` after ONNX Runtime's CPU graph optimizations."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(path)
    options.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return Counter(node.op_type for node in onnx.load(str(path)).graph.node)


def _run_unoptimized(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_the_rewritten_gelu_is_bitwise_equal_and_fused(tmp_path):
    """The rewritten graph computes bit for bit what the exporter's form did (each op unfused, over
    values from 1e-30 to 1e30 of both signs), and ONNX Runtime fuses it into one Gelu where it left
    the original as five ops."""
    original = _gelu_graph()
    rewritten = onnx.ModelProto.FromString(original.SerializeToString())
    assert rewrite_gelu(rewritten.graph) == 1
    onnx.checker.check_model(rewritten, full_check=True)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 8)) * 10.0 ** rng.integers(-30, 30, (64, 8))).astype(np.float32)
    np.testing.assert_array_equal(_run_unoptimized(rewritten, x), _run_unoptimized(original, x))
    assert _optimized_ops(original, tmp_path / "original.onnx")["Erf"] == 1
    assert _optimized_ops(rewritten, tmp_path / "rewritten.onnx") == Counter({"Gelu": 1})


@pytest.mark.parametrize("half, divisor", [(0.25, 2**0.5), (0.5, 2.0)])
def test_other_functions_are_left_alone(half, divisor):
    """A different factor or divisor is not a GELU: nothing is rewritten."""
    model = _gelu_graph(half, divisor)
    before = model.SerializeToString()
    assert rewrite_gelu(model.graph) == 0
    assert model.SerializeToString() == before


def test_a_gelu_whose_intermediate_is_read_elsewhere_is_left_alone():
    """The rewrite changes the value of the Mul by 0.5: where a graph output also shows that value,
    nothing is rewritten."""
    model = _gelu_graph()
    model.graph.output.append(helper.make_tensor_value_info("halved", TensorProto.FLOAT, ["N", 8]))
    before = model.SerializeToString()
    assert rewrite_gelu(model.graph) == 0
    assert model.SerializeToString() == before


def test_exported_vits_run_fused_gelus(small_vit, tmp_path):
    """Every block's GELU of an exported ViT (dynamo exporter) reaches ONNX Runtime in the form it
    fuses: its optimized graph has no Erf left, one BiasGelu (the fc1 bias with the GELU) per block."""
    model = small_vit()
    export_onnx(model, tmp_path / "model.onnx", (3, 32, 32))
    ops = _optimized_ops(onnx.load(str(tmp_path / "model.onnx")), tmp_path / "optimized.onnx")
    assert ops["Erf"] == 0 and ops["BiasGelu"] == len(model.blocks)
