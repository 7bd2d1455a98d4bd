"""What ``bench`` measures: the compressed model and its dense base, from an artifact or an export."""

from __future__ import annotations

from pathlib import Path

from corp_deploy import CorpError, latest_artifact
from corp_deploy.artifact import CONFIG_FILE, Artifact
from corp_deploy.files import checked_path
from corp_deploy.outputs import read_record
from exporters.manifest import MANIFEST, ExportManifest, model_files, read_manifest
from exporters.precision import PRECISIONS

from .backends import ModelFiles
from .data import folders_overlap


def resolve_target(path: str | Path | None) -> tuple[Path, Path | None]:
    """``(artifact, export directory or None)`` for an artifact, an export directory, or None
    (the most recent artifact): :func:`find_target` with the artifact's folder."""
    artifact, export = find_target(path)
    return artifact.path, export


def find_target(path: str | Path | None) -> tuple[Artifact, Path | None]:
    """``(artifact, export directory or None)`` for an artifact, an export directory, or None
    (the most recent artifact), the artifact read (:class:`~corp_deploy.artifact.Artifact`). An
    artifact's export is the first ``export-*`` inside it by :func:`_export_preference`
    (``export-fp32`` first); an export's artifact is the one it lies in, else the one its manifest
    names. The export must have been made from exactly that artifact (its ``config.json`` and
    weights have the SHA-256s the manifest recorded)."""
    if path is None:
        path = latest_artifact()
    path = checked_path(path, "the artifact or export")
    if (path / MANIFEST).is_file():
        manifest = read_manifest(path)
        # an export inside an artifact belongs to it (also after both were moved or copied)
        inside = (path.parent / CONFIG_FILE).is_file()
        artifact = Artifact.read(path.parent if inside else Path(manifest.artifact.path))
        check_made_from(artifact, path, manifest)
        return artifact, path
    artifact = Artifact.read(path)
    # an export is known by its export.json or by its record (one whose export.json was removed is damaged, not absent)
    exports = [p for p in path.glob("export-*") if (p / MANIFEST).is_file() or read_record(p) is not None]
    if not exports:
        return artifact, None
    export = min(exports, key=_export_preference)
    check_made_from(artifact, export, read_manifest(export))
    return artifact, export


def _export_preference(export: Path) -> tuple[int, str]:
    """The order bench picks an artifact's exports in: ``export-fp32``, then the other precisions
    ONNX Runtime's CPU provider runs (in :data:`~exporters.precision.PRECISIONS` order: fp16, int8),
    then the rest (bf16, exports of other names) by name."""
    runs_on_cpu = [name for name, precision in PRECISIONS.items() if not precision.not_on_cpu]
    named = export.name.removeprefix("export-")
    return (runs_on_cpu.index(named) if named in runs_on_cpu else len(runs_on_cpu), export.name)


def check_made_from(artifact: Path | Artifact, export: Path, manifest: ExportManifest) -> None:
    """CorpError unless ``export`` (with its read ``manifest``) was made from ``artifact`` as it was
    read, and holds the precision its name says (``export-int8`` int8, ...): bench finds the graphs
    it compares by those names."""
    artifact = Artifact.of(artifact)
    made_from = manifest.artifact
    if artifact.checksums != {"config_sha256": made_from.config_sha256, "weights_sha256": made_from.weights_sha256}:
        raise CorpError(f"{export} was exported from a different version of {artifact}; export it again")
    named = export.name.removeprefix("export-")
    if export.name.startswith("export-") and named in PRECISIONS and manifest.precision != named:
        raise CorpError(
            f"{export} holds {manifest.precision} graphs, not {named} ones as its name says "
            f"(bench reads export-fp32/ and export-int8/ by name); export it again into export-{named}/"
        )


def load_models(artifact: Path | Artifact, export: Path | None) -> tuple[ModelFiles, ModelFiles]:
    """``(compressed, dense)``: PyTorch modules plus the export's ONNX files and engines, every
    file checked against its record first."""
    artifact = Artifact.of(artifact)
    files = {"model": {}, "dense": {}}
    if export is not None:
        manifest = read_manifest(export)
        for key in manifest.models:
            made = {"precision": manifest.precision, "exporter": manifest.exporter, "opset": manifest.opset}
            files[key] = {**model_files(export, manifest, key), **made}
    compressed = ModelFiles(artifact.model, **files["model"])
    dense = ModelFiles(artifact.dense(), **files["dense"])
    return compressed, dense


def copied_calibration_images(artifact: Artifact, eval_digests: set[str], eval_pixels: set[str]) -> tuple[int, int]:
    """``(copies, other bytes)``: how many of the evaluation images are copies of a file the artifact
    was calibrated on, wherever the copy lies, and how many of those are not byte-identical to it.
    By :func:`~corp_deploy.calibration.pixel_digest` (``eval_pixels``) against the artifact's
    ``pixel_digests``: identical pixels, whatever the format; an artifact made before those were
    recorded is compared by :func:`~corp_deploy.calibration.file_digest` (``eval_digests``) against its
    ``image_digests``: byte-identical copies only. ``(0, 0)`` for an artifact calibrated on the bundled
    photos, or made before any digest was recorded."""
    calibration = artifact.config.calibration
    byte_identical = len(eval_digests & set(calibration.get("image_digests", [])))
    if "pixel_digests" not in calibration:
        return byte_identical, 0
    copies = len(eval_pixels & set(calibration["pixel_digests"]))
    return copies, max(0, copies - byte_identical)


def calibration_overlap(artifact: Artifact, eval_description: dict) -> bool:
    """Whether the evaluation images may have been seen in calibration (then they are not
    held out): folders that can share files (:func:`~benchmarks.data.folders_overlap`), or
    bundled photos that calibration also used."""
    calib = artifact.config.calibration
    if eval_description["source"] == "builtin":
        return calib.get("source") == "builtin" and bool(set(calib.get("photos", [])) & set(eval_description["photos"]))
    return calib.get("source") == "directory" and folders_overlap(calib["path"], eval_description["path"])
