"""``export.json``: what an export directory holds, how it was made and how well it matched.

Every reader checks ``export.json`` and the graph and engine files it uses against the export's
record (:mod:`corp_deploy.outputs`) before anything runs; file names in the manifest are plain
names inside the export folder."""

from __future__ import annotations

import platform
from pathlib import Path

from corp_deploy import CorpError
from corp_deploy.outputs import read_recorded_json, verify_files

MANIFEST = "export.json"
FORMAT = "corp-deploy-export"
#: 2: the export folder has a record of every file (version 1 had none and is not read).
FORMAT_VERSION = 2


def versions() -> dict:
    """Versions of the libraries an export depends on (``tensorrt`` is None where it is missing)."""
    import onnx
    import onnxruntime
    import polygraphy
    import timm
    import torch

    import corp_deploy

    from .tensorrt import tensorrt_version

    return {
        "corp_deploy": corp_deploy.__version__,
        "torch": torch.__version__,
        "timm": timm.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "polygraphy": polygraphy.__version__,
        "tensorrt": tensorrt_version(),
        "python": platform.python_version(),
    }


def read_manifest(folder: str | Path) -> dict:
    """The ``export.json`` of an export directory, checked against the export's record."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise CorpError(f"{folder} is not a corp-deploy export (no {MANIFEST})")
    manifest = read_recorded_json(folder, MANIFEST, "export", FORMAT, FORMAT_VERSION, "export the artifact again")
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
