"""Label-free recovery: a short distillation of the compressed model from the dense one it was
compressed from, on the same unlabelled calibration images (docs/method.md §11).

The compressed model (the student, its dims fixed) is trained to reproduce the dense model (the
teacher) block by block: the loss is the mean over blocks of ``1 - cosine`` between the student's
and the teacher's residual stream after the block, per token, plus ``final_weight`` times the same
for the final features (``forward_features``). Only the blocks and the final norm learn; the
embeddings and the head stay as they are (so the teacher can be checked against the student: their
patch embeddings must be equal). AdamW, a linear warmup and a cosine decay. Each step trains on
fresh augmented views of the calibration images' files (:class:`RecoveryImages`): the images
compression was fitted on are matched closely already, and views it has not seen carry the
signal.

A share of the images is held out for validation: the student is measured there before the first
step and every ``eval_every`` steps (the mean cosine of the model's outputs, pooled features or
logits, to the teacher's), recovery stops when ``patience`` measurements in a row did not improve,
and the weights of the best measurement are kept, CORP's own if none beat them: a recovery never
leaves the model worse on validation than compression left it.

Under torch.distributed the student is wrapped in ``DistributedDataParallel``: every process draws
the same global batch and runs its share of it, torch averages the gradients, so the result equals
one process's up to the order of float sums.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import distributed
from .calibration import load_rgb, model_transform
from .errors import CorpError, SettingError, check_setting_types
from .families import blocks_of
from .methods.base import option

#: The prefix of the recovery's settings where they sit beside the compression's (``recover_steps``).
SETTING_PREFIX = "recover_"
#: The most steps a recovery may take (a million steps of 16 images: days on a GPU; more never ends
#: in practice).
MAX_STEPS = 1_000_000


@dataclass(frozen=True)
class RecoveryConfig:
    """How to recover (measured defaults: benchmarks/RESULTS.md, "Recovery").

    Attributes:
        steps: optimisation steps at most; 0 switches recovery off.
        lr: AdamW's peak learning rate.
        batch_size: images per step (under torch.distributed: in all, split over the processes).
        weight_decay: AdamW's decoupled weight decay.
        warmup: the fraction of the steps over which the learning rate rises linearly from 0.
        validation: the fraction of the images held out for validation (at least one image).
        eval_every: steps between two validation measurements.
        patience: measurements in a row without improvement after which recovery stops.
        crop_scale: the smallest area of a random resized crop, as a fraction of the image.
        color: augment with colour jitter, greyscale and blur too (:class:`RecoveryImages`).
        final_weight: the weight of the final features' term beside the blocks' mean.
        seed: the seed of the validation split, the batches and the augmentation.
        autocast_bf16: on CUDA, run the forward passes in bfloat16 autocast.
    """

    steps: int = option(0, "label-free recovery: distillation steps after compression (0: off).")
    lr: float = option(2e-5, "recovery: AdamW's peak learning rate.")
    batch_size: int = option(16, "recovery: images per step.")
    weight_decay: float = 0.0
    warmup: float = 0.1
    validation: float = option(0.125, "recovery: fraction of the calibration images held out for validation.")
    eval_every: int = option(25, "recovery: steps between two validation measurements.")
    patience: int = option(4, "recovery: stop after this many measurements without improvement.")
    crop_scale: float = option(0.25, "recovery: smallest random crop, as a fraction of the image.")
    color: bool = True
    final_weight: float = 1.0
    seed: int = 0
    autocast_bf16: bool = True

    def __post_init__(self) -> None:
        check_setting_types(self, lambda name: SETTING_PREFIX + name)
        integers = {
            "steps": (0, MAX_STEPS),
            "batch_size": (1, None),
            "eval_every": (1, None),
            "patience": (1, None),
            "seed": (0, None),
        }
        for name, (least, most) in integers.items():
            value = getattr(self, name)
            if not (value >= least and (most is None or value <= most)):
                bounds = f">= {least}" if most is None else f"from {least} to {most:,}"
                raise SettingError(f"{{setting}} must be an integer {bounds}, got {value!r}", SETTING_PREFIX + name)
        ranges = {
            "lr": (0.0, 1.0, False),
            "weight_decay": (0.0, 10.0, True),
            "warmup": (0.0, 1.0, True),
            "validation": (0.0, 1.0, False),
            "crop_scale": (0.0, 1.0, False),
            "final_weight": (0.0, 100.0, True),
        }
        for name, (low, high, low_included) in ranges.items():
            value = getattr(self, name)
            if not (math.isfinite(value) and (low <= value if low_included else low < value) and value <= high):
                interval = f"{'[' if low_included else '('}{low:g}, {high:g}]"
                raise SettingError(f"{{setting}} must be in {interval}, got {value!r}", SETTING_PREFIX + name)

    @property
    def enabled(self) -> bool:
        return self.steps > 0

    def to_settings(self) -> dict:
        """The flat settings an artifact records (``recover_steps``, ...)."""
        return {SETTING_PREFIX + name: value for name, value in asdict(self).items()}

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        return tuple(SETTING_PREFIX + field.name for field in fields(cls))

    @classmethod
    def from_settings(cls, settings: dict) -> RecoveryConfig:
        """The config from flat settings (``recover_steps=...``); other entries are ignored."""
        return cls(**{name[len(SETTING_PREFIX) :]: v for name, v in settings.items() if name in cls.setting_names()})


class _Features(nn.Module):
    """``model.forward_features`` as a module's forward, for DistributedDataParallel (which
    synchronises the gradients of what runs through its wrapped module's forward)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.forward_features(images)


class _BlockOutputs:
    """The residual stream after every block of ``model``, captured on each forward (a hook per
    block); ``clear()`` before a forward, ``remove()`` when done."""

    def __init__(self, model: nn.Module) -> None:
        self.outputs: list[torch.Tensor] = []
        self._handles = [b.register_forward_hook(lambda m, i, o: self.outputs.append(o)) for b in blocks_of(model)]

    def clear(self) -> None:
        self.outputs = []

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def distillation_loss(
    student_blocks: list[torch.Tensor],
    teacher_blocks: list[torch.Tensor],
    student_features: torch.Tensor,
    teacher_features: torch.Tensor,
    final_weight: float,
) -> torch.Tensor:
    """Mean over blocks of the mean over tokens of ``1 - cos`` between the residual streams (each
    ``(B, N, C)``, or a Swin's ``(B, H, W, C)``; cosine over ``C``), plus ``final_weight`` times the
    same for the final features; a scalar in float32."""

    def distance(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (1 - F.cosine_similarity(s.float(), t.float(), dim=-1)).mean()

    blocks = torch.stack([distance(s, t) for s, t in zip(student_blocks, teacher_blocks)]).mean()
    return blocks + final_weight * distance(student_features, teacher_features)


def _lr_factor(step: int, config: RecoveryConfig) -> float:
    """The learning rate at ``step`` (0-based) as a fraction of ``config.lr``: linear warmup, then cosine."""
    warmup = round(config.warmup * config.steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, config.steps - warmup)))


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters recovery trains: those of the blocks and of the final norm (``norm``; a
    pooled model's ``fc_norm`` too), by name."""
    owners = [*blocks_of(model), *(getattr(model, name, None) for name in ("norm", "fc_norm"))]
    ids = {id(p) for module in owners if isinstance(module, nn.Module) for p in module.parameters()}
    return {name: p for name, p in model.named_parameters() if id(p) in ids}


def check_teacher(student: nn.Module, teacher: nn.Module) -> None:
    """CorpError unless ``teacher`` can be the dense model ``student`` was compressed from: the same
    number of blocks and the same patch embedding (which compression never changes)."""
    if len(blocks_of(student)) != len(blocks_of(teacher)):
        raise CorpError(
            f"the dense model has {len(blocks_of(teacher))} blocks and the compressed one "
            f"{len(blocks_of(student))}: it is not the model this one was compressed from"
        )
    ours, theirs = student.patch_embed.state_dict(), teacher.patch_embed.state_dict()
    if ours.keys() != theirs.keys() or any(not torch.equal(ours[k], theirs[k].to(ours[k].device)) for k in ours):
        raise CorpError(
            "the dense model's patch embedding differs from the compressed model's: these are not the "
            "weights it was compressed from (recover with the dense model compress started from)"
        )


class RecoveryImages:
    """What recovery trains and validates on, made from the calibration images.

    The images' sources (the file each came from, when the batches say so with an
    ``image_sources`` list, as :class:`~corp_deploy.calibration.CalibrationImages` do; else each
    image is its own source) are split, seeded: a ``validation`` share of the sources (at least
    one, at most 256) is held out, and the validation images are the calibration images of those
    sources, as compression saw them. Training draws fresh augmented views of the other sources:
    random resized crops of the whole file (of the image itself for a bare tensor), mirrored, and
    with ``color`` colour jitter, greyscale and blur, as self-supervised training augments
    (SimCLR, DINO).

    Args:
        batches: preprocessed images ``(B, 3, H, W)``.
        data_config: the model's timm data config (``mean``, ``std``, ``input_size``).
    """

    def __init__(self, batches: Iterable[torch.Tensor], data_config: dict, config: RecoveryConfig) -> None:
        images = torch.cat([batch.to(torch.float32) for batch in batches])
        sources = list(getattr(batches, "image_sources", None) or range(len(images)))
        distinct = list(dict.fromkeys(sources))
        held = min(256, max(1, round(config.validation * len(distinct))))
        if len(distinct) - held < 1:
            raise CorpError(
                f"recovery needs calibration images from at least 2 sources (one to train on, one to "
                f"validate); got {len(distinct)}"
            )
        order = torch.randperm(len(distinct), generator=torch.Generator().manual_seed(config.seed)).tolist()
        validation = {distinct[i] for i in order[:held]}
        self.validation = images[[i for i, source in enumerate(sources) if source in validation]]
        self.mean = torch.tensor(data_config["mean"]).view(3, 1, 1)
        self.std = torch.tensor(data_config["std"]).view(3, 1, 1)
        self._train = [
            source if isinstance(source, Path) else (images[source] * self.std + self.mean).clamp(0, 1)
            for source in (distinct[i] for i in order[held:])
        ]
        self._augment = _augmentation(tuple(data_config["input_size"][1:]), config)
        self._seed = config.seed

    @property
    def sources(self) -> tuple[int, int]:
        """``(training, validation)`` source counts."""
        return len(self._train), len(self.validation)

    def views(self, indices: list[int], step: int) -> torch.Tensor:
        """Augmented views ``(len(indices), 3, H, W)`` of the training sources ``indices``,
        preprocessed; the same for the same ``step`` in every process."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self._seed * 1_000_003 + step)
            views = torch.stack([self._augment(self._pixels(self._train[i])) for i in indices])
        return (views - self.mean) / self.std

    def _pixels(self, source: Path | torch.Tensor) -> torch.Tensor:
        """A training source as ``(3, h, w)`` floats in [0, 1]."""
        if isinstance(source, torch.Tensor):
            return source
        from torchvision.transforms.v2.functional import pil_to_tensor

        return pil_to_tensor(load_rgb(source)).float() / 255


def _augmentation(size: tuple[int, int], config: RecoveryConfig):
    """The training views' transform, on ``(3, h, w)`` images in [0, 1], ending normalised."""
    from torchvision.transforms import v2

    color = []
    if config.color:
        blur = 2 * round(0.05 * max(size)) + 1  # an odd kernel of a tenth of the image (SimCLR)
        color = [
            v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
            v2.RandomGrayscale(p=0.2),
            v2.RandomApply([v2.GaussianBlur(blur, sigma=(0.1, 2.0))], p=0.5),
        ]
    return v2.Compose(
        [
            v2.RandomResizedCrop(size, scale=(config.crop_scale, 1.0), antialias=True),
            v2.RandomHorizontalFlip(),
            *color,
        ]
    )


@torch.no_grad()
def _validate(student: nn.Module, teacher: nn.Module, images: torch.Tensor, batch: int, autocast) -> float:
    """Mean over ``images`` of the cosine between the two models' outputs (pooled features or
    logits), summed over the processes of torch.distributed (each measures its share)."""
    cosines, count = 0.0, 0
    device = next(student.parameters()).device
    share = images[distributed.rank() :: distributed.world_size()]
    for start in range(0, len(share), batch):
        x = share[start : start + batch].to(device)
        with autocast():
            s, t = student(x), teacher(x)
        cosines += float(F.cosine_similarity(s.float().flatten(1), t.float().flatten(1), dim=1).double().sum())
        count += len(x)
    cosines, count = distributed.sum_floats(cosines, count)
    return cosines / count


def recover(
    student: nn.Module,
    teacher: nn.Module,
    calibration_batches: Iterable[torch.Tensor],
    config: RecoveryConfig,
    *,
    progress: bool = False,
) -> dict:
    """Distil ``student`` (the compressed model, trained in place on its device) from ``teacher``
    (the dense model it was compressed from, moved to the same device) on the images of
    ``calibration_batches`` ``(B, 3, H, W)``, as the module docstring says. Returns the recovery's
    report: its settings, the steps run, why it stopped, the best step, and per measurement the
    step, the running training loss, the validation cosine and the learning rate; ``student``
    holds the best weights, in eval mode."""
    check_teacher(student, teacher)
    device = next(student.parameters()).device
    student.eval()  # dropout and drop-path off: the function inference computes is the one trained
    teacher = teacher.to(device).eval()
    images = RecoveryImages(calibration_batches, model_transform(student)[1], config)
    world = distributed.world_size()
    if config.batch_size % world:
        raise SettingError(
            f"{{setting}} {config.batch_size} must be a multiple of the {world} processes (each runs an equal share)",
            SETTING_PREFIX + "batch_size",
        )
    use_bf16 = config.autocast_bf16 and device.type == "cuda"

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if use_bf16 else nullcontext()

    for parameter in teacher.parameters():
        parameter.requires_grad_(False)
    trained = trainable_parameters(student)
    requires_grad = {name: p.requires_grad for name, p in student.named_parameters()}
    for parameter in student.parameters():
        parameter.requires_grad_(False)
    for parameter in trained.values():
        parameter.requires_grad_(True)
    features = _Features(student)
    if distributed.active():
        features = nn.parallel.DistributedDataParallel(features)
    optimizer = torch.optim.AdamW(list(trained.values()), lr=config.lr, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, config))
    generator = torch.Generator().manual_seed(config.seed + 1)
    teacher_blocks, student_blocks = _BlockOutputs(teacher), _BlockOutputs(student)

    start_cosine = _validate(student, teacher, images.validation, config.batch_size, autocast)
    best = {"step": 0, "cosine": start_cosine, "weights": _copy(trained)}
    curve = [{"step": 0, "loss": None, "validation_cosine": start_cosine, "lr": 0.0}]
    stop, running, stale, step = "steps done", None, 0, 0
    started = time.perf_counter()
    try:
        with _Progress(progress, config.steps, start_cosine) as bar:
            order = _Batches(images.sources[0], config.batch_size, generator)
            for step in range(1, config.steps + 1):
                x = images.views(order.next(), step)[distributed.rank() :: world].to(device)
                teacher_blocks.clear(), student_blocks.clear()
                with torch.no_grad(), autocast():
                    teacher_features = teacher.forward_features(x)
                with autocast():
                    student_features = features(x)
                loss = distillation_loss(
                    student_blocks.outputs,
                    teacher_blocks.outputs,
                    student_features,
                    teacher_features,
                    config.final_weight,
                )
                if not torch.isfinite(loss):
                    raise CorpError(
                        f"recovery stopped at step {step} of {config.steps}: the loss is not finite "
                        f"({float(loss.detach())}); nothing was written (try a lower --recover-lr)"
                    )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                value = distributed.sum_floats(float(loss.detach()))[0] / world
                running = value if running is None else 0.9 * running + 0.1 * value
                bar.step(running)
                if step % config.eval_every and step != config.steps:
                    continue
                cosine = _validate(student, teacher, images.validation, config.batch_size, autocast)
                curve.append(
                    {"step": step, "loss": running, "validation_cosine": cosine, "lr": schedule.get_last_lr()[0]}
                )
                bar.validated(cosine)
                if cosine > best["cosine"]:
                    best, stale = {"step": step, "cosine": cosine, "weights": _copy(trained)}, 0
                else:
                    stale += 1
                if stale >= config.patience:
                    stop = f"validation did not improve in {config.patience} measurements"
                    break
    finally:
        teacher_blocks.remove(), student_blocks.remove()
        for name, parameter in student.named_parameters():
            parameter.requires_grad_(requires_grad[name])
    with torch.no_grad():
        for name, parameter in trained.items():
            parameter.copy_(best["weights"][name])
    student.eval()
    return {
        "settings": asdict(config),
        "images": {"training_sources": images.sources[0], "validation": images.sources[1]},
        "steps_run": step,
        "stopped": stop,
        "best_step": best["step"],
        "validation_cosine": {"compressed": start_cosine, "recovered": best["cosine"]},
        "curve": curve,
        "trained_parameters": sum(p.numel() for p in trained.values()),
        "time_s": round(time.perf_counter() - started, 2),
        "bf16_autocast": use_bf16,
    }


def _copy(parameters: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in parameters.items()}


class _Batches:
    """Indices of training batches: the images in a seeded random order, epoch after epoch."""

    def __init__(self, count: int, batch: int, generator: torch.Generator) -> None:
        self._count, self._batch, self._generator = count, batch, generator
        self._order: list[int] = []

    def next(self) -> list[int]:
        while len(self._order) < self._batch:
            self._order += torch.randperm(self._count, generator=self._generator).tolist()
        taken, self._order = self._order[: self._batch], self._order[self._batch :]
        return taken


class _Progress:
    """Progress on stderr: steps, the running loss, the last validation cosine, time left."""

    def __init__(self, enabled: bool, steps: int, start_cosine: float) -> None:
        self._bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("recovering"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}  validation cosine {task.fields[cosine]}"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self._task = self._bar.add_task("", total=steps, loss="-", cosine=f"{start_cosine:.4f}")

    def __enter__(self) -> _Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def step(self, loss: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=1, loss=f"{loss:.4f}")

    def validated(self, cosine: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, cosine=f"{cosine:.4f}")


def recovery_table(report: dict, path=None):
    """A recovery's report (:func:`recover`) as a rich table: steps run and why it stopped, the
    best step, the validation cosine before and after, and the time."""
    from rich.table import Table

    cosine = report["validation_cosine"]
    table = Table(title="recovery" + (f" -> {path}" if path else ""))
    table.add_column("")
    table.add_column("", justify="right")
    table.add_row("steps run", f"{report['steps_run']} ({report['stopped']})")
    table.add_row("weights kept from step", str(report["best_step"]))
    images = report["images"]
    table.add_row(
        f"validation output cosine ({images['validation']} held-out images)",
        f"{cosine['compressed']:.4f} -> {cosine['recovered']:.4f}",
    )
    table.add_row("recovery wall time (s)", f"{report['time_s']:.1f}")
    return table
