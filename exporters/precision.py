"""The export precisions, one :class:`Precision` record each, and their registry.

A record says how its graph is made (the model traced in ``dtype`` under the policy of
:mod:`exporters.reduced_precision`; int8 traces float32 and quantizes that graph on calibration
images, :mod:`exporters.quantize`), the parity gate's default limits, where ONNX Runtime can check
the graph, what the TensorRT build script says about it, and its own options. The CLI (choices,
the default limits in ``--help``, which options it refuses), :func:`exporters.export_artifact`
and ``bench`` (which ``export-<name>`` folder holds which graphs) read :data:`PRECISIONS`: a new
precision is one record here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from corp_deploy.errors import check_choice

from .int8_options import Int8Options
from .parity import Tolerance


@dataclass(frozen=True)
class Precision:
    """One value of ``corp-deploy export --precision``.

    Attributes:
        name: the ``--precision`` value, ``export.json``'s ``precision``, the ``export-<name>``
            folder's suffix.
        dtype: the type the model is traced in (float32: as it is; float16 / bfloat16: the policy
            of :mod:`exporters.reduced_precision`).
        tolerance: the parity gate's default limits (``--atol`` and ``--min-cosine`` override them).
        calibrates: whether the traced float32 graph is then quantized with ranges calibrated on
            images (its parity images are then photos that calibration never uses).
        options_class: the class of its own options (``ExportOptions.int8``), None when it has none.
        onnxruntime_device: the ONNX Runtime device the parity gate runs the graph on
            (:class:`exporters.runners.OnnxRuntimeRunner`); when it is not the CPU,
            ``not_on_cpu`` says why, for the message where that device is missing.
        tensorrt_note: lines of the TensorRT build script's header about this precision.
    """

    name: str
    dtype: torch.dtype
    tolerance: Tolerance
    calibrates: bool = False
    options_class: type | None = None
    onnxruntime_device: str = "cpu"
    not_on_cpu: str = ""
    tensorrt_note: tuple[str, ...] = ()


#: Every precision by name, in the order ``--help`` lists them. fp32 must match to float32
#: round-off. Reduced precision changes every intermediate result, so it is judged by direction
#: (cosine) and decisions (top-1), not by 1e-5. int8 rounds every Linear input to 255 levels:
#: looser again (README, "INT8").
PRECISIONS: dict[str, Precision] = {
    precision.name: precision
    for precision in (
        Precision("fp32", torch.float32, Tolerance(atol=1e-4, min_cosine=0.99999)),
        Precision("fp16", torch.float16, Tolerance(min_cosine=0.999, min_top1=0.85)),
        Precision(
            "bf16",
            torch.bfloat16,
            Tolerance(min_cosine=0.99, min_top1=0.85),
            onnxruntime_device="cuda",
            not_on_cpu="ONNX Runtime's CPU provider has no bfloat16 kernels",
        ),
        Precision(
            "int8",
            torch.float32,
            Tolerance(min_cosine=0.98, min_top1=0.75),
            calibrates=True,
            options_class=Int8Options,
            tensorrt_note=(
                "int8: the QuantizeLinear/DequantizeLinear pairs are TensorRT's explicit quantization, built",
                "strongly typed with no precision flag (TensorRT's documentation: no --int8 with Q/DQ)",
            ),
        ),
    )
}


def precision_named(name: str, among: tuple[str, ...] = tuple(PRECISIONS)) -> Precision:
    """The record of ``name``; SettingError listing ``among`` (default: every precision) when
    ``name`` is not one of them."""
    check_choice("precision", name, among)
    return PRECISIONS[name]


def precision_tolerance(name: str, **overrides: float | None) -> Tolerance:
    """The default limits of precision ``name`` (its record's :attr:`~Precision.tolerance`) with the
    given non-None ``overrides``; SettingError as :func:`precision_named` for an unknown name."""
    return precision_named(name).tolerance.with_limits(**overrides)


#: The precisions whose graph is the traced model itself (the others are made from it).
TRACED = tuple(name for name, precision in PRECISIONS.items() if not precision.calibrates)
