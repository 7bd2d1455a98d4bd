"""ONNX and TensorRT exporters for corp-deploy artifacts.

One module per concern:

- ``onnx_export``: a ViT to one checked ONNX file with a dynamic batch axis;
- ``precision``: the fp16 / bf16 graph policy (LayerNorm, softmax, patch embedding in fp32);
- ``runners``: the ``Runner`` protocol, PyTorch and ONNX Runtime backends (``tensorrt`` has the
  TensorRT one);
- ``metrics``: cosine, top-1 agreement and KL divergence of two outputs (parity and ``bench``);
- ``parity``: the output comparator, its typed results (``Comparison``, ``ParityCheck``) and the
  tolerance gate;
- ``results``: what an export returns (``ModelExport``, ``ExportResult``);
- ``tensorrt``: engine build (Polygraphy), runner, and the ``trtexec`` script;
- ``manifest``: ``export.json``;
- ``pipeline``: ``export_artifact``, what ``corp-deploy export`` runs.
"""

from .onnx_export import export_onnx
from .parity import Tolerance, compare_outputs
from .pipeline import ExportOptions, ExportResult, ParityError, export_artifact
from .tensorrt import BatchProfile

__all__ = [
    "BatchProfile",
    "ExportOptions",
    "ExportResult",
    "ParityError",
    "Tolerance",
    "compare_outputs",
    "export_artifact",
    "export_onnx",
]
