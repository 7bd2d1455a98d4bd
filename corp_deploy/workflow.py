"""The workflow, one home for ``corp-deploy compress``, ``recover``, ``sweep`` and library callers:
a dense model, a :class:`~corp_deploy.config.CompressConfig` and a
:class:`~corp_deploy.calibration.CalibrationSpec` in, an artifact out; or an artifact and a
:class:`~corp_deploy.recovery.RecoveryConfig` in, a recovered artifact out.

    result = compress_to_artifact(dense, CompressConfig(s_mlp=0.5), CalibrationSpec(samples=128), "out/deit")
    result = recover_artifact("out/deit", RecoveryConfig(steps=100), "out/deit-recovered")
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torch import nn

from . import distributed
from .artifact import Artifact, write_artifact
from .base_model import base_model_spec, check_base_model, check_dense_weights, complete_base_model
from .calibration import CalibrationImages, CalibrationSpec, summary_warnings
from .config import CompressConfig
from .engine import compress, compress_bytes
from .errors import BadUsage, CorpError, SettingError, check_flags, check_instance
from .files import checked_path
from .models import model_transform
from .outputs import check_apart, check_output_dir
from .recovery import SETTING_PREFIX, RecoveryConfig
from .resources import check_fits, training_bytes


@dataclass(frozen=True)
class CompressedArtifact:
    """What :func:`compress_to_artifact` made.

    Attributes:
        path: the artifact folder; None on every process but the first under torch.distributed,
            which writes nothing.
        model: the compressed model (eval mode, on the CPU).
        report: the compress report (:func:`corp_deploy.compress`).
        calibration: the calibration summary (:meth:`CalibrationImages.summary`): where the
            images came from, how many were asked for and used, which files were skipped.
    """

    path: Path | None
    model: nn.Module
    report: dict
    calibration: dict

    def calibration_warnings(self) -> list[str]:
        """What the user should hear about the calibration (:func:`~corp_deploy.calibration.summary_warnings`)
        and, after a recovery, about the sources it found to be copies of another."""
        copies = self.report.get("recovery", {}).get("images", {}).get("duplicate_sources", 0)
        duplicates = (
            [
                f"recovery: {copies} calibration source{'s were' if copies != 1 else ' was'} a copy of another "
                "(the same pixels): counted once, on the same side of the split (validation holds no copy of a "
                "training image)"
            ]
            if copies
            else []
        )
        return summary_warnings(self.calibration) + duplicates


class ImagesInMemory:
    """Calibration batches read once and held in memory, for work that compresses one model
    several times (a sweep): iterating gives the same batches, ``summary()``, ``image_sources`` and
    ``most`` those of the read (:class:`~corp_deploy.calibration.CalibrationImages`)."""

    def __init__(self, images: CalibrationImages) -> None:
        self._batches = list(images)
        self._summary = images.summary()
        self.image_sources = list(images.image_sources)
        self.most = images.most

    def __iter__(self):
        return iter(self._batches)

    def summary(self) -> dict:
        return self._summary


def compress_to_artifact(
    dense: nn.Module,
    config: CompressConfig,
    calibration: CalibrationSpec,
    out_dir: str | Path | None,
    *,
    base_model: dict[str, Any] | None = None,
    images: ImagesInMemory | None = None,
    progress: bool = False,
    in_place: bool = False,
    plots: bool = True,
) -> CompressedArtifact:
    """Calibrate on ``calibration``'s images, compress ``dense`` with ``config`` and write the
    artifact to ``out_dir`` (atomically; None only where nothing is written, on a process but the
    first under torch.distributed; the settings it records are the config's and the
    calibration's, :meth:`CompressConfig.to_dict` and :meth:`CalibrationSpec.settings`).

    Refuses up front (CorpError) when the work would not fit in memory. ``base_model``: the
    record of the dense model (name, creation arguments, weights) as the CLI builds it; None
    infers it (:func:`corp_deploy.base_model.base_model_spec`) without weights. A weights record
    (:data:`corp_deploy.base_model.WEIGHTS_FORMS`) is checked to rebuild ``dense`` exactly before the
    work (timm's pretrained weights are taken as given). ``images``: ``calibration``'s images
    already read (:class:`ImagesInMemory`); None reads them. ``in_place`` compresses ``dense`` itself
    (one copy of the weights less; after a failure it is left part-compressed). Under
    torch.distributed every process calibrates on its share and only the first writes.
    """
    check_instance("dense", dense, nn.Module)
    check_instance("config", config, CompressConfig)
    check_instance("calibration", calibration, CalibrationSpec)
    check_flags(progress=progress, in_place=in_place, plots=plots)
    if out_dir is None and distributed.rank() == 0:
        raise BadUsage(
            "out_dir is None: give the artifact's folder (None only on the processes of torchrun but the first)"
        )
    if out_dir is not None:
        checked_path(out_dir, "out_dir")
        check_output_dir(out_dir, "artifact")  # before any work (checked again where it is written)
        check_apart([out_dir], {"the calibration folder": calibration.source})
    transform, data_config = model_transform(dense)
    inferred = base_model is None
    if inferred:
        base_model = base_model_spec(dense)
    check_base_model(base_model, dense, inferred=inferred)
    base_model = complete_base_model(base_model)  # the weights record completed once, as config.json records it
    if base_model["weights"] is not None:
        check_dense_weights(base_model, dense)
    return _compressed_artifact(
        dense,
        config,
        calibration,
        out_dir,
        base_model,
        transform,
        data_config,
        images=images,
        progress=progress,
        in_place=in_place,
        plots=plots,
    )


def _compressed_artifact(
    dense: nn.Module,
    config: CompressConfig,
    calibration: CalibrationSpec,
    out_dir: str | Path | None,
    base_model: dict[str, Any],
    transform: Callable,
    data_config: dict,
    *,
    images: ImagesInMemory | None = None,
    progress: bool = False,
    in_place: bool = False,
    plots: bool = True,
) -> CompressedArtifact:
    """:func:`compress_to_artifact` once its inputs are checked: ``base_model`` the dense model's
    record as ``config.json`` records it (:func:`~corp_deploy.base_model.complete_base_model`), checked
    to rebuild ``dense``; ``transform`` and ``data_config`` its preprocessing. Refuses what would not
    fit in memory, then compresses and writes."""
    if images is None:
        images = calibration.images(transform)  # the files listed once, read as they are compressed
    count = images.most
    input_size = tuple(data_config["input_size"])
    check_fits(
        f"compressing {base_model['name']} on {count} images",
        compress_bytes(dense, input_size, count, calibration.batch_size),
        "use fewer --calib-samples or a smaller --batch-size",
    )
    recovery = config.recovery
    if recovery.enabled and not recovery.checkpointing and config.device == "cpu":  # its activations, besides
        check_fits(
            f"recovering at {recovery.batch_size} images per step",
            training_bytes(dense, input_size, recovery.batch_size),
            "use a smaller --recover-batch-size, or --recover-checkpointing",
        )
    model, report = compress(dense, images, config, progress=progress, in_place=in_place)
    summary = images.summary()
    if distributed.rank() != 0:
        return CompressedArtifact(None, model, report, summary)
    _, compressed_data_config = model_transform(model)
    path = write_artifact(
        model,
        out_dir,
        base_model,
        compressed_data_config,
        settings={**config.to_dict(), **calibration.settings()},
        calibration=summary,
        report=report,
        plots=plots,
    )
    return CompressedArtifact(path, model, report, summary)


def recover_artifact(
    artifact: str | Path | Artifact,
    recovery: RecoveryConfig,
    out_dir: str | Path,
    *,
    calibration: CalibrationSpec | None = None,
    device: str = "cpu",
    progress: bool = False,
) -> CompressedArtifact:
    """``artifact`` (its folder, or the :class:`~corp_deploy.artifact.Artifact` read already)
    compressed again as it was, this time with ``recovery``, written to ``out_dir`` as a new
    artifact (``artifact`` is only read).

    The dense model is rebuilt from the artifact's record (and checked against its weights) and compressed
    with its recorded settings on its recorded calibration images (``calibration`` instead where
    given), as ``compress --recover-steps`` would: the recovery's validation images must be held
    out from compression too, which the artifact's own weights, fitted on every calibration image,
    cannot give (:class:`~corp_deploy.recovery.RecoveryImages`). ``recovery.seed`` is used as given
    (``corp-deploy recover`` gives the artifact's recorded seed, as ``compress --seed`` gives its seed
    to both). An artifact that was recovered already is compressed again the same way and recovered
    anew with ``recovery``: its recovery is replaced, not continued."""
    if not isinstance(artifact, Artifact):
        checked_path(artifact, "artifact")
    checked_path(out_dir, "out_dir")
    check_instance("recovery", recovery, RecoveryConfig)
    check_flags(progress=progress)
    if not recovery.enabled:
        raise SettingError(
            "{setting} must be at least 1 to recover an artifact (0 is off: the artifact is what compress wrote)",
            SETTING_PREFIX + "steps",
        )
    if calibration is not None:
        check_instance("calibration", calibration, CalibrationSpec)
    artifact = Artifact.of(artifact)
    artifact.verified_weights()  # not read here, but a damaged artifact is not recovered
    settings = artifact.config.settings
    missing = [name for name in ("method", *CalibrationSpec.ALWAYS_RECORDED) if name not in settings]
    if missing:
        raise CorpError(
            f"{artifact} does not record the settings it was compressed with ({', '.join(missing)} missing: "
            "save_artifact was given no settings, or others), and recover compresses the dense model again with "
            "them; compress it with the recovery instead (compress --recover-steps, or CompressConfig(recovery=...))"
        )
    try:  # what the artifact records, checked apart from what is given: it is no usage of the caller's
        recorded = CompressConfig.from_dict(settings)
    except SettingError as exc:
        raise CorpError(f"{artifact} records compression settings this corp-deploy cannot use: {exc}") from None
    compression = replace(recorded, recovery=recovery, device=device)
    check_apart([out_dir], {"the artifact to recover": artifact})
    dense = artifact.dense()  # rebuilt from the artifact's record, and checked against its weights
    calibration = calibration or CalibrationSpec.recorded(artifact.config.calibration, settings)
    check_output_dir(out_dir, "artifact")  # before any work (checked again where it is written)
    check_apart([out_dir], {"the calibration folder": calibration.source})
    transform, data_config = model_transform(dense)
    return _compressed_artifact(
        dense,
        compression,
        calibration,
        out_dir,
        artifact.base_model.to_dict(),
        transform,
        data_config,
        progress=progress,
        in_place=True,
    )
