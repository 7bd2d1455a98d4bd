"""``export.json``: what an export directory holds, how it was made and how well it matched.

Every reader checks ``export.json`` and the graph and engine files it uses against the export's
record (:mod:`corp_deploy.outputs`) before anything runs; file names in the manifest are plain
names inside the export folder."""

from __future__ import annotations

from pathlib import Path

from corp_deploy import CorpError
from corp_deploy.documents import DocumentFormat, library_versions
from corp_deploy.outputs import read_record, read_recorded_json, verify_files

MANIFEST = "export.json"
#: 2: the export folder has a record of every file (version 1 had none and is not read).
MANIFEST_FORMAT = DocumentFormat("corp-deploy-export", 2, "export", "export the artifact again", file=MANIFEST)


def versions() -> dict:
    """Versions of the libraries an export depends on (``tensorrt`` is None where it is missing)."""
    return library_versions(("torch", "timm", "onnx", "onnxruntime", "polygraphy"), optional=("tensorrt",))


def read_manifest(folder: str | Path) -> dict:
    """The ``export.json`` of an export directory, checked against the export's record."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file() and read_record(folder) is None:  # with a record: "export.json is missing"
        raise CorpError(f"{folder} is not a corp-deploy export (no {MANIFEST})")
    manifest = read_recorded_json(folder, "export", MANIFEST_FORMAT)
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise CorpError(f"{path} is malformed: {problem}")
    return manifest


def _manifest_problem(manifest: dict) -> str | None:
    """What in an ``export.json`` (its record matching, i.e. edited along with the record) a reader
    cannot use, or None."""
    artifact, models = manifest.get("artifact"), manifest.get("models")
    if not (
        isinstance(artifact, dict)
        and all(isinstance(artifact.get(key), str) for key in ("path", "config_sha256", "weights_sha256"))
    ):
        return "artifact needs its path and the SHA-256 of its config and weights"
    if not (isinstance(models, dict) and "model" in models):
        return "models needs the compressed model"
    for key, entry in models.items():
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("onnx"), list)
            and entry["onnx"]
            and all(isinstance(name, str) for name in entry["onnx"])
            and (entry.get("engine") is None or isinstance(entry["engine"], str))
        ):
            return f"models.{key} needs a list of ONNX file names and an engine name or null"
    return None


def model_files(folder: str | Path, manifest: dict, key: str) -> dict[str, Path | None]:
    """``{"onnx": graph path, "engine": engine path or None}`` of the manifest's model ``key``
    (``model`` or ``dense``), every file (the graph's external weights too) checked against the
    export's record."""
    folder = Path(folder)
    entry = manifest["models"][key]
    names = [*entry["onnx"], *([entry["engine"]] if entry["engine"] else [])]
    verify_files(folder, "export", names)
    return {"onnx": folder / entry["onnx"][0], "engine": folder / entry["engine"] if entry["engine"] else None}
