"""Exported graphs rewritten into the forms ONNX Runtime's optimizer fuses, exact in float.

The dynamo exporter writes the erf GELU of timm's MLPs as ``x * ((erf(x / sqrt 2) + 1) * 0.5)``.
ONNX Runtime fuses a GELU into one ``Gelu`` kernel (and, after a bias, ``BiasGelu``) only when it
is written ``(x * 0.5) * (erf(x / sqrt 2) + 1)``; otherwise it runs five elementwise passes over
the MLP's widest activation. :func:`rewrite_gelu` moves the factor 0.5 from the one operand to
the other. Multiplying by 0.5 is exact in float (short of subnormals), so both forms round the
same product once: op by op the outputs are bitwise equal; ONNX Runtime's fused kernel then
computes the GELU at float rounding of its own (within 2.4e-7 of the five ops on fp32 inputs).
Measured on DeiT-B compressed at s = 0.5, batch 32, ONNX Runtime CPU (lab/studies/gelu_form.py,
lab/RESULTS.md "INT8: output rounding, smoothing, entropy"): the fused form 1.02x faster
than the exporter's in fp32 (p10-p90 1.00-1.04) and in int8 (0.97-1.04; there fc2's smoothing
scale then takes a Mul after the GELU instead of the GELU's constant).
"""

from __future__ import annotations

import math

import numpy as np


def rewrite_gelu(graph) -> int:
    """Rewrite every ``x * ((erf(x / sqrt 2) + 1) * 0.5)`` of ``graph`` (an ``onnx.GraphProto``,
    changed in place) into ``(x * 0.5) * (erf(x / sqrt 2) + 1)``. Returns how many were rewritten."""
    constants = scalar_initializers(graph)
    producers = {out: node for node in graph.node for out in node.output}
    readers = _read_counts(graph)
    rewritten = 0
    for product in graph.node:
        for x, half_name in _operand_orders(product):
            half = producers.get(half_name)
            plus_one_name = _times_half(half, constants)
            if (
                plus_one_name is None
                or readers[half_name] != 1
                or erf_gelu_input(producers.get(plus_one_name), producers, constants) != x
            ):
                continue
            half.input[:] = [x, next(i for i in half.input if i != plus_one_name)]
            product.input[:] = [half.output[0], plus_one_name]
            rewritten += 1
            break
    return rewritten


def is_fusable_gelu(node, producers: dict, constants: dict[str, float]) -> bool:
    """Whether ``node`` is the last op of a GELU written ``(x * 0.5) * (erf(x / sqrt 2) + 1)``,
    the form ONNX Runtime fuses."""
    for half_name, plus_one_name in _operand_orders(node):
        x = erf_gelu_input(producers.get(plus_one_name), producers, constants)
        if x is not None and x == _times_half(producers.get(half_name), constants):
            return True
    return False


def erf_gelu_input(plus_one, producers: dict, constants: dict[str, float]) -> str | None:
    """The ``x`` of ``plus_one`` when that node computes ``erf(x / sqrt 2) + 1``, else None."""
    if plus_one is None or plus_one.op_type != "Add" or len(plus_one.input) != 2:
        return None
    erf_name = _other_than_constant(plus_one, constants, 1.0)
    erf = producers.get(erf_name) if erf_name else None
    divide = producers.get(erf.input[0]) if erf is not None and erf.op_type == "Erf" else None
    if (
        divide is None
        or divide.op_type != "Div"
        or not math.isclose(constants.get(divide.input[1], 0.0), math.sqrt(2), rel_tol=1e-3)
    ):
        return None
    return divide.input[0]


def _times_half(node, constants: dict[str, float]) -> str | None:
    """The other operand of ``node`` when it is a Mul by the constant 0.5, else None."""
    return _other_than_constant(node, constants, 0.5) if node is not None and node.op_type == "Mul" else None


def _other_than_constant(node, constants: dict[str, float], value: float) -> str | None:
    """For a two-input ``node`` with exactly one input the constant ``value``: the other input."""
    if len(node.input) != 2 or [constants.get(i) == value for i in node.input].count(True) != 1:
        return None
    return next(i for i in node.input if constants.get(i) != value)


def _operand_orders(node) -> list[tuple[str, str]]:
    """A two-input Mul's operands in both orders (none for any other node)."""
    if node.op_type != "Mul" or len(node.input) != 2:
        return []
    return [(node.input[0], node.input[1]), (node.input[1], node.input[0])]


def scalar_initializers(graph) -> dict[str, float]:
    """``{name: value}`` of the one-value float initializers (float32, float16, bfloat16) of ``graph``."""
    from onnx import TensorProto, numpy_helper

    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
    return {
        t.name: float(numpy_helper.to_array(t).reshape(()))
        for t in graph.initializer
        if int(np.prod(t.dims)) == 1 and t.data_type in floats
    }


def _read_counts(graph) -> dict[str, int]:
    """How many times each value of ``graph`` is read: as a node input, as a graph output, or
    anywhere inside a node's subgraphs (If / Loop bodies, which may read the outer graph's values)."""
    from onnx import AttributeProto

    counts: dict[str, int] = {}
    for name in [i for node in graph.node for i in node.input] + [o.name for o in graph.output]:
        counts[name] = counts.get(name, 0) + 1
    for node in graph.node:
        for attribute in node.attribute:
            subgraphs = (
                [attribute.g]
                if attribute.type == AttributeProto.GRAPH
                else (list(attribute.graphs) if attribute.type == AttributeProto.GRAPHS else [])
            )
            for subgraph in subgraphs:
                for name, count in _read_counts(subgraph).items():
                    counts[name] = counts.get(name, 0) + count
    return counts
