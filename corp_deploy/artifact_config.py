"""An artifact's ``config.json`` as a typed document (:mod:`corp_deploy.documents`): what rebuilds
the compressed model (the dense model's record, the input, every block's dims and biases) and how it
was made (the settings, the calibration, the libraries, the time). Its entries are the fields, in
order; reading checks each one, and a document read is written back the same."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from .documents import Document, DocumentFormat, Record
from .errors import CorpError
from .layers import BlockDims

CONFIG_FILE = "config.json"
#: ``config.json``'s format (also the weights file's ``format`` metadata). 2: the artifact has a record
#: with every file's SHA-256 (version 1 had none and is not read).
CONFIG_FORMAT = DocumentFormat("corp-deploy-artifact", 2, "artifact", "compress the model again", file=CONFIG_FILE)


@dataclass(frozen=True)
class BaseModelRecord(Record):
    """The dense model compression started from: timm's ``name``, the ``model_kwargs`` it was created
    with, and where its weights came from (``weights``: the record of
    :func:`~corp_deploy.base_model.complete_weights_record`; None where none was given)."""

    model_kwargs: dict
    name: str
    weights: dict | None = None

    def __post_init__(self) -> None:
        weights = self.weights or {}
        needs = {"checkpoint": {"path": str, "sha256": str}, "random": {"seed": int}}.get(weights.get("source"), {})
        for entry, kind in needs.items():
            if not isinstance(weights.get(entry), kind) or isinstance(weights.get(entry), bool):
                raise CorpError(f"weights needs its {entry} ({_KINDS[kind]}) for the source {weights['source']!r}")


@dataclass(frozen=True)
class InputRecord(Record):
    """The images the model takes: ``input_size`` ``(C, H, W)`` and timm's data config of the model
    (its preprocessing), with every value JSON holds."""

    input_size: tuple[int, ...]
    data_config: dict

    def __post_init__(self) -> None:
        if len(self.input_size) != 3 or any(size <= 0 for size in self.input_size):
            raise CorpError("input_size needs three positive integers")


@dataclass(frozen=True)
class ArtifactConfig(Document):
    """``config.json``: ``base_model`` and ``input``; ``blocks``, each block's dims after compression,
    in order, with whether its MLP's second layer (``fc2_bias``) and its attention's output projection
    (``proj_bias``) have a bias (None: as timm builds them); a budget's ``allocation`` (None without
    one); the run's ``settings`` (:meth:`~corp_deploy.config.CompressConfig.to_dict` with the
    calibration's and recovery's) and the ``calibration`` summary; the ``versions`` of the libraries
    and when it was ``created``."""

    FORMAT: ClassVar[DocumentFormat] = CONFIG_FORMAT

    base_model: BaseModelRecord
    input: InputRecord
    blocks: tuple[BlockDims, ...]
    allocation: dict | None = None
    fc2_bias: tuple[bool, ...] | None = None
    proj_bias: tuple[bool, ...] | None = None
    settings: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    created: str | None = None

    def __post_init__(self) -> None:
        for name in ("fc2_bias", "proj_bias"):
            flags = getattr(self, name)
            if flags is not None and len(flags) != len(self.blocks):
                raise CorpError(f"{name} needs one entry per block")
        for index, dims in enumerate(self.blocks):
            if dims.scale is not None and not (math.isfinite(dims.scale) and dims.scale > 0):
                raise CorpError(f"blocks row {index}.scale must be a finite number > 0, not {dims.scale}")
        problem = _calibration_problem(self.calibration)
        if problem is not None:
            raise CorpError(f"calibration.{problem}")


#: The calibration summary's sources: a folder's images, the bundled photos.
CALIBRATION_SOURCES = ("directory", "builtin")

#: How the messages name the JSON types the records' own checks want.
_KINDS = {str: "a string", int: "an integer"}


def _calibration_problem(calibration: dict) -> str | None:
    """What of the calibration summary's entries that the tool reads (the source, a folder's path,
    the photos' names, the files' digests) is missing or of the wrong type, or None. A source other
    than a folder's or the bundled photos' is refused: read as neither, it would calibrate on other images."""
    if "source" in calibration and calibration["source"] not in CALIBRATION_SOURCES:
        return f"source must be one of {', '.join(map(repr, CALIBRATION_SOURCES))}, not {calibration['source']!r}"
    if calibration.get("source") == "directory" and not isinstance(calibration.get("path"), str):
        return "path needs the calibration folder (a string) for the source 'directory'"
    for entry in ("photos", "image_digests", "pixel_digests"):
        names = calibration.get(entry, [])
        if not (isinstance(names, list) and all(isinstance(name, str) for name in names)):
            return f"{entry} must be a list of strings"
    return None
