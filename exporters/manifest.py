"""``export.json``: what an export directory holds, how it was made and how well it matched.

Every reader checks ``export.json`` and the graph and engine files it uses against the export's
record (:mod:`corp_deploy.outputs`) before anything runs; file names in the manifest are plain
names inside the export folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from corp_deploy import CorpError
from corp_deploy.documents import Document, DocumentFormat, Record, library_versions, optional_entry
from corp_deploy.outputs import read_record, read_recorded_json, verify_files

MANIFEST = "export.json"
#: 2: the export folder has a record of every file (version 1 had none and is not read).
MANIFEST_FORMAT = DocumentFormat("corp-deploy-export", 2, "export", "export the artifact again", file=MANIFEST)


def versions() -> dict:
    """Versions of the libraries an export depends on (``tensorrt`` is None where it is missing)."""
    return library_versions(("torch", "timm", "onnx", "onnxruntime", "polygraphy"), optional=("tensorrt",))


@dataclass(frozen=True, kw_only=True)
class MadeFrom(Record):
    """The artifact an export was made from: its ``path``, its dense model's timm name, its method,
    and its record's SHA-256 of its ``config.json`` and weights (what bench checks the artifact
    against)."""

    path: str
    base_model: str | None = optional_entry()
    method: str | None = None
    config_sha256: str
    weights_sha256: str


@dataclass(frozen=True, kw_only=True)
class ModelEntry(Record):
    """One model of an export (``model``, the compressed one, or ``dense``): its ONNX file(s), the
    first the graph and the others its external data; its engine (None until built); its size; its
    parity checks by name; the int8 quantizer's record (int8 only) and the engine's build."""

    onnx: tuple[str, ...]
    engine: str | None = None
    params: int | None = optional_entry()
    macs: int | None = optional_entry()
    parity: dict = field(default_factory=dict)
    int8: dict | None = optional_entry()
    engine_build: dict | None = optional_entry()

    def __post_init__(self) -> None:
        if not self.onnx:
            raise CorpError("onnx needs at least one ONNX file name")


@dataclass(frozen=True, kw_only=True)
class ExportManifest(Document):
    """``export.json``: when, from which artifact (:class:`MadeFrom`), the precision, exporter and
    opset, the graph's inputs, outputs and dynamic axes, the model's data config, the parity inputs and
    limits, every model (:class:`ModelEntry`; ``model`` always), TensorRT's settings and whether it
    built, and the libraries' versions. Entries an older export lacks are left out as they were."""

    FORMAT: ClassVar[DocumentFormat] = MANIFEST_FORMAT

    created: str | None = optional_entry()
    artifact: MadeFrom
    precision: str
    exporter: str
    opset: int
    inputs: list | None = optional_entry()
    outputs: list | None = optional_entry()
    dynamic_axes: dict | None = optional_entry()
    data_config: dict | None = optional_entry()
    parity_inputs: dict | None = optional_entry()
    tolerance: dict | None = optional_entry()
    models: dict[str, ModelEntry]
    tensorrt: dict = field(default_factory=dict)
    versions: dict | None = optional_entry()

    def __post_init__(self) -> None:
        if "model" not in self.models:
            raise CorpError("models needs the compressed model")
        for key, entry in self.models.items():
            kept = (entry.int8 or {}).get("kept_float")
            names = isinstance(kept, list) and all(isinstance(n, str) for n in kept) and len(set(kept)) == len(kept)
            if self.precision == "int8" and not names:
                raise CorpError(
                    f"models.{key}.int8 needs the quantizer's record (kept_float: a list of distinct layer names)"
                )


def read_manifest(folder: str | Path) -> ExportManifest:
    """The ``export.json`` of an export directory, checked against the export's record and entry by
    entry (CorpError naming the first bad one)."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file() and read_record(folder) is None:  # with a record: "export.json is missing"
        raise CorpError(f"{folder} is not a corp-deploy export (no {MANIFEST})")
    return ExportManifest.from_dict(read_recorded_json(folder, "export", MANIFEST_FORMAT), path)


def model_files(folder: str | Path, manifest: ExportManifest, key: str) -> dict[str, Path | None]:
    """``{"onnx": graph path, "engine": engine path or None}`` of the manifest's model ``key``
    (``model`` or ``dense``), every file (the graph's external weights too) checked against the
    export's record."""
    folder = Path(folder)
    entry = manifest.models[key]
    verify_files(folder, "export", [*entry.onnx, *([entry.engine] if entry.engine else [])])
    return {"onnx": folder / entry.onnx[0], "engine": folder / entry.engine if entry.engine else None}
