"""What the nodes of an exported ONNX graph are: the matrix products that Linear layers (and
attention's two activation products) become, and the PyTorch module each node was exported from.

Shared by the int8 quantizer (:mod:`exporters.quantize`: which ops get int8 inputs, which layers
stay in float) and the smoothing rewrite (:mod:`exporters.smoothing`: which weights take a scale).
"""

from __future__ import annotations

import ast

#: The ops a Linear layer exports to (its weight an initializer, the second input; ``Gemm``
#: without ``transB`` or ``MatMul``: ``(in, out)``, ``Gemm`` with ``transB``: ``(out, in)``). The
#: attention matmuls ``q k^T`` and ``softmax(.) v`` are ``MatMul`` too, of two activations.
MATMUL_OPS = ("MatMul", "Gemm")


def module_path(node) -> str:
    """The PyTorch module an ONNX node was exported from (``blocks.0.attn.qkv``): from the dynamo
    exporter's ``pkg.torch.onnx.name_scopes`` metadata, else from the TorchScript exporter's scoped
    node name (``/blocks/blocks.0/attn/qkv/MatMul``); empty when the node has neither."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            scopes = ast.literal_eval(prop.value)
            return scopes[-2] if len(scopes) > 1 else ""
    if not node.name.startswith("/"):
        return ""
    path = ""
    for scope in node.name.split("/")[1:-1]:  # each scope is a child's name, or a qualified name
        path = scope if not path or scope.startswith(path + ".") else f"{path}.{scope}"
    return path
