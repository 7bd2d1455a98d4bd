"""What ``export_artifact`` is asked for (:class:`ExportOptions`): the settings every precision
shares, checked together, and the precision's own options."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from corp_deploy import CorpError
from corp_deploy.errors import SettingError, check_instance, check_setting_types

from . import tensorrt as trt_backend
from .int8_options import Int8Options
from .onnx_export import DEFAULT_EXPORTER, DEFAULT_OPSET, check_settings
from .parity import Tolerance
from .precision import precision_named

#: The TensorRT workspace limits ``--workspace`` accepts, in GB (trtexec takes whole MiB).
MIN_WORKSPACE_GB, MAX_WORKSPACE_GB = 1 / 1024, 1e6


@dataclass(frozen=True)
class ExportOptions:
    """What ``export_artifact`` writes and how: the settings every precision shares, and the
    precision's own options (``int8``: :class:`~exporters.int8_options.Int8Options`).

    ``precision`` names a record of :data:`exporters.precision.PRECISIONS`; ``tolerance`` None
    means that record's default limits; ``workspace_gb`` None leaves TensorRT's workspace
    unbounded; ``timing_cache`` is read if it exists and updated. ``int8`` is for
    ``precision="int8"`` only (None there: the defaults) and refused with any other.
    """

    trt: bool = False
    dense: bool = False
    opset: int = DEFAULT_OPSET
    exporter: str = DEFAULT_EXPORTER
    precision: str = "fp32"
    batch: trt_backend.BatchProfile = trt_backend.BatchProfile()
    workspace_gb: float | None = None
    timing_cache: Path | None = None
    tolerance: Tolerance | None = None
    int8: Int8Options | None = None

    def __post_init__(self) -> None:
        check_setting_types(self)
        check_instance("batch", self.batch, trt_backend.BatchProfile)
        check_settings(self.opset, self.exporter)
        takes_int8 = precision_named(self.precision).options_class is Int8Options
        if self.int8 is not None and not takes_int8:
            raise SettingError(
                f"the int8 options ({{setting}}: calibration, keep-float, smoothing, activations, calibration images) "
                f"apply only with {{setting}} int8, not {self.precision}",
                "int8",
                "precision",
            )
        if self.int8 is None and takes_int8:
            object.__setattr__(self, "int8", Int8Options())
        if self.int8 is not None:
            self.int8.check(trt=self.trt)
        if self.workspace_gb is not None and not MIN_WORKSPACE_GB <= self.workspace_gb <= MAX_WORKSPACE_GB:
            raise SettingError(
                f"{{setting}} must be a number of GB from {MIN_WORKSPACE_GB:g} (1 MiB) to "
                f"{MAX_WORKSPACE_GB:g}; got {self.workspace_gb}",
                "workspace_gb",
            )
        if self.timing_cache is not None:
            cache = Path(self.timing_cache)
            if cache.is_dir() or not cache.parent.is_dir():
                raise CorpError(
                    f"the TensorRT timing cache {cache} is "
                    + (
                        "a directory, not a file"
                        if cache.is_dir()
                        else f"in a folder that does not exist: {cache.parent}"
                    )
                )
            object.__setattr__(self, "timing_cache", cache.resolve())
        if not self.trt and (self.workspace_gb is not None or self.timing_cache is not None):
            raise SettingError(
                "{setting} and {setting} configure the TensorRT build; they apply only with {setting}",
                "workspace_gb",
                "timing_cache",
                "trt",
            )
