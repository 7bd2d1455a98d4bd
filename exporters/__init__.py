"""ONNX and TensorRT exporters for corp-deploy artifacts.

One module per concern:

- ``onnx_export``: a ViT to one checked ONNX file with a dynamic batch axis;
- ``precision``: the fp16 / bf16 graph policy (LayerNorm, softmax, patch embedding in fp32);
- ``runners``: PyTorch and ONNX Runtime backends (``tensorrt`` has the TensorRT one);
- ``parity``: the output comparator and the tolerance gate;
- ``tensorrt``: engine build (Polygraphy), runner, and the ``trtexec`` script;
- ``manifest``: ``export.json``;
- ``pipeline``: ``export_artifact``, what ``corp-deploy export`` runs.
"""
from .onnx_export import export_onnx
from .parity import Tolerance, compare_outputs
from .pipeline import ExportOptions, ExportResult, ParityError, export_artifact
from .tensorrt import BatchProfile

__all__ = ["BatchProfile", "ExportOptions", "ExportResult", "ParityError", "Tolerance", "compare_outputs",
           "export_artifact", "export_onnx"]
