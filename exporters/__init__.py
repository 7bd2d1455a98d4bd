"""ONNX and TensorRT exporters for corp-deploy artifacts.

One module per concern:

- ``onnx_export``: a ViT to one checked ONNX file with a dynamic batch axis;
- ``precision``: the export precisions, one ``Precision`` record each (``PRECISIONS``): how the
  graph is made, the parity gate's default limits, ONNX Runtime's device, its own options;
- ``reduced_precision``: the fp16 / bf16 graph policy (LayerNorm, softmax, patch embedding in fp32);
- ``quantize``, ``smoothing``, ``keep_float``, ``int8_options``: the int8 graph (``onnx_nodes``:
  which nodes are Linear layers, from which module) and its options (``Int8Options``);
- ``runners``: the ``Runner`` protocol, PyTorch and ONNX Runtime backends (``tensorrt`` has the
  TensorRT one);
- ``parity``: the output comparator, its typed results (``Comparison``, ``ParityCheck``) and the
  tolerance gate;
- ``results``: what an export returns (``ModelExport``, ``ExportResult``);
- ``tensorrt``: engine build (Polygraphy), runner, and the ``trtexec`` script;
- ``manifest``: ``export.json``;
- ``options``: ``ExportOptions``, what an export is asked for;
- ``pipeline``: ``export_artifact``, what ``corp-deploy export`` runs.
"""

from .int8_options import Int8Options
from .onnx_export import export_onnx
from .options import ExportOptions
from .parity import Tolerance, compare_outputs
from .pipeline import ExportResult, ParityError, export_artifact
from .precision import PRECISIONS, Precision
from .tensorrt import BatchProfile

__all__ = [
    "PRECISIONS",
    "BatchProfile",
    "ExportOptions",
    "ExportResult",
    "Int8Options",
    "ParityError",
    "Precision",
    "Tolerance",
    "compare_outputs",
    "export_artifact",
    "export_onnx",
]
