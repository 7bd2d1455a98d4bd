"""The int8 precision's own options (``corp-deploy export --precision int8`` with ``--int8-*``,
``--calib``, ``--calib-samples``): one validated config, as ModelOpt has one per mode."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from corp_deploy.errors import BadUsage, SettingError, check_choice, check_setting_types, described
from corp_deploy.files import existing_dir

from .keep_float import AUTO
from .quantize import ACTIVATION_TYPES, CALIBRATION_METHODS, DEFAULT_ACTIVATIONS, DEFAULT_CALIBRATION
from .smoothing import DEFAULT_ALPHA


def _option(default: object, flag: str):
    """A field of :class:`Int8Options` set on the command line by ``flag``."""
    return field(default=default, metadata={"flag": flag})


@dataclass(frozen=True)
class Int8Options:
    """How an int8 graph is calibrated and quantized; every value is checked here.

    ``calibration``: the range method (:data:`exporters.quantize.CALIBRATION_METHODS`);
    ``keep_float``: how many Linear layers stay in float, or ``"auto"`` (:mod:`exporters.keep_float`);
    ``smoothing``: the strength of the outlier migration (:mod:`exporters.smoothing`), None for
    none; ``activations``: the type of the Linear layers' inputs
    (:data:`exporters.quantize.ACTIVATION_TYPES`; ``uint8`` not for TensorRT, see :meth:`check`);
    ``calib``: the calibration image directory, recorded absolute (None: the source the artifact
    was compressed with, as its config.json records it); ``calib_samples``: how many images (None:
    as many as compress used). Each field's ``flag`` metadata is its command-line option.
    """

    calibration: str = _option(DEFAULT_CALIBRATION, "--int8-calibration")
    keep_float: int | str = _option(AUTO, "--int8-keep-float")
    smoothing: float | None = _option(DEFAULT_ALPHA, "--int8-smoothing")
    activations: str = _option(DEFAULT_ACTIVATIONS, "--int8-activations")
    calib: Path | None = _option(None, "--calib")
    calib_samples: int | None = _option(None, "--calib-samples")

    def __post_init__(self) -> None:
        setting = {field: keyword for keyword, field in self.keywords().items()}.get
        check_setting_types(self, setting)
        check_choice(setting("calibration"), self.calibration, tuple(CALIBRATION_METHODS))
        check_choice(setting("activations"), self.activations, tuple(ACTIVATION_TYPES))
        if self.smoothing is not None and not 0 <= self.smoothing <= 1:
            raise SettingError(f"{{setting}} must be from 0 to 1 or None, got {self.smoothing!r}", setting("smoothing"))
        if self.keep_float != AUTO and not (isinstance(self.keep_float, int) and self.keep_float >= 0):
            raise SettingError(
                f"{{setting}} (the Linear layers kept in float) must be {AUTO!r} or a number >= 0, got "
                f"{described(self.keep_float)}",
                setting("keep_float"),
            )
        if self.calib is not None:  # recorded absolute: resolves the same from anywhere
            object.__setattr__(self, "calib", existing_dir(self.calib, "calib"))  # (export checks --calib first)
        if self.calib_samples is not None and self.calib_samples < 1:
            raise SettingError(f"{{setting}} must be >= 1, got {self.calib_samples}", setting("calib_samples"))

    def check(self, *, trt: bool) -> None:
        """BadUsage when these options cannot give a graph for the runtime asked for (``trt``:
        TensorRT engines too)."""
        if trt and self.activations != DEFAULT_ACTIVATIONS:
            raise BadUsage(
                f"--int8-activations {self.activations} is for ONNX Runtime on the CPU: TensorRT "
                f"needs signed int8 activations with symmetric ranges (--int8-activations "
                f"{DEFAULT_ACTIVATIONS}, the default)"
            )

    @classmethod
    def flags(cls) -> dict[str, str]:
        """``{field name: command-line option}``, in the fields' order."""
        return {f.name: f.metadata["flag"] for f in dataclasses.fields(cls)}

    @classmethod
    def keywords(cls) -> dict[str, str]:
        """``{keyword: field name}``: each option's flag as a Python name (``int8_smoothing``,
        ``calib``), the ``export`` command's parameter."""
        return {flag.lstrip("-").replace("-", "_"): name for name, flag in cls.flags().items()}
