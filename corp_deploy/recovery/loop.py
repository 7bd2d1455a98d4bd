"""Recovery's loop (:func:`recover`): the training steps on fresh views, a validation measurement
every ``eval_every`` steps, early stopping, the best weights kept, and the report."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict

import torch
from torch import nn

from .. import distributed
from ..calibration import BATCHES
from ..errors import BadUsage, SettingError, check_flags, check_instance
from ..families import standard_copy
from ..models import model_transform
from ..progress import RecoveryProgress
from .config import SETTING_PREFIX, RecoveryConfig
from .images import RecoveryImages, training_batches
from .loss import check_teacher
from .training import _Distillation, trainable_parameters
from .validation import Validation


def recover(
    student: nn.Module,
    teacher: nn.Module,
    images: Iterable[torch.Tensor] | RecoveryImages,
    config: RecoveryConfig,
    *,
    progress: bool = False,
    on_measure: Callable[[int, nn.Module], None] | None = None,
) -> dict:
    """Distil ``student`` (the compressed model, trained in place on its device) from ``teacher``
    (the dense model it was compressed from, moved to the same device and put in eval mode; a copy
    of it where its family's blocks are rewritten for compression:
    :func:`~corp_deploy.families.standard_copy`) on ``images``, as :mod:`corp_deploy.recovery` says:
    calibration batches ``(B, 3, H, W)``, or the :class:`RecoveryImages` made of them before
    compressing on their :meth:`~RecoveryImages.fit_batches` (then no validation image was seen by
    compression: :func:`corp_deploy.compress` does that). Returns the recovery's report: its
    settings, the steps run, why it stopped, the best step, and per measurement the step, the
    running training loss and both validation cosines; ``student`` holds the best weights, in eval
    mode (also after a failure: compression's weights then). ``on_measure(step, student)``, if
    given, is called at each validation measurement (step 0 included) with the student holding the
    weights measured, the blended ones (for studies and logging; it must not train). ``progress``:
    show progress on stderr (a bar on a terminal, else one line per validation measurement)."""
    check_instance("config", config, RecoveryConfig)
    check_instance("student", student, nn.Module, "a timm ViT (torch.nn.Module)")
    check_instance("teacher", teacher, nn.Module, "a timm ViT (torch.nn.Module)")
    check_instance("images", images, (Iterable, RecoveryImages), f"{BATCHES}, or RecoveryImages")
    check_flags(progress=progress)
    if not config.enabled:
        raise SettingError(
            "{setting} must be at least 1 to recover (0 is off: nothing would train)", SETTING_PREFIX + "steps"
        )
    _check_distinct(student, teacher, config)
    check_teacher(student, teacher)
    world = distributed.world_size()
    if config.batch_size % world:
        raise SettingError(
            f"{{setting}} {config.batch_size} must be a multiple of the {world} processes (each runs an equal share)",
            SETTING_PREFIX + "batch_size",
        )
    device = next(student.parameters()).device
    student.eval()  # dropout and drop-path off: the function inference computes is the one trained
    # the student's blocks are in standard form (a Swin block ends with the next stage's patch
    # merging): the teacher's block outputs are compared with them in the same form
    teacher = standard_copy(teacher).to(device).eval()
    if not isinstance(images, RecoveryImages):
        images = RecoveryImages(images, model_transform(student)[1], config)
    run = _Distillation(student, teacher, config)
    started = time.perf_counter()
    validation = Validation(run, images, config, on_measure)
    stop, running, step = "steps done", None, 0
    pinned = device.type == "cuda"
    try:
        with (
            training_batches(images.training, config.steps, config.workers, pinned) as batches,
            RecoveryProgress(progress, config.steps, validation.start["cosine"]) as bar,
        ):
            for step, views in enumerate(batches, 1):
                loss = run.step(views[distributed.rank() :: world].to(device, non_blocking=pinned), step)
                running = loss if running is None else 0.9 * running + 0.1 * loss
                bar.step(running)
                if step % config.eval_every and step != config.steps:
                    continue
                stopped = validation.measured(step, running)
                bar.validated(validation.last_cosine)
                if stopped is not None:
                    stop = stopped
                    break
    finally:
        run.close(validation.best["weights"])
    best, start = validation.best, validation.start
    return {
        "settings": asdict(config),
        "images": {
            "training_sources": images.sources[0],
            "validation_sources": images.sources[1],
            "validation_views": len(images.validation),
            "duplicate_sources": images.duplicates,
        },
        "steps_run": step,
        "stopped": stop,
        "best_step": best["step"],
        "validation_cosine": {"compressed": start["cosine"], "recovered": best["cosine"]},
        "distorted_validation_cosine": {"compressed": start["distorted"], "recovered": best["distorted"]},
        "curve": validation.curve,
        "trained_parameters": sum(p.numel() for p in run.trained.values()),
        "time_s": round(time.perf_counter() - started, 2),
        "bf16_autocast": run.bf16,
    }


def _check_distinct(student: nn.Module, teacher: nn.Module, config: RecoveryConfig) -> None:
    """BadUsage when ``student`` and ``teacher`` are one module, or a parameter that ``config`` trains
    (:func:`~corp_deploy.recovery.training.trainable_parameters`) shares its storage with a tensor of
    the teacher: training would move the teacher it is measured against (frozen tensors may be shared)."""
    if student is teacher:
        raise BadUsage(
            "student and teacher are the same module: recovery distils the compressed model (student) from "
            "the dense one it was compressed from (teacher), which must be another module"
        )
    held = {tensor.untyped_storage().data_ptr() for tensor in teacher.state_dict().values() if tensor.numel()}
    held.discard(0)  # no data to share (the meta device)
    for name, parameter in trainable_parameters(student, config.train, config.final_weight > 0).items():
        if parameter.numel() and parameter.untyped_storage().data_ptr() in held:
            raise BadUsage(
                f"student and teacher share the tensor of the student's {name}: training the student would change "
                "the teacher too; give the teacher weights of its own (copy.deepcopy)"
            )
