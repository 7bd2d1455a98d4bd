"""Label-free recovery: a short distillation of the compressed model from the dense one it was
compressed from, on the same unlabelled calibration images (docs/method.md §11).

The compressed model (the student, its dims fixed) is trained to reproduce the dense model (the
teacher) block by block: the loss is the mean over blocks of ``1 - cosine`` between the student's
and the teacher's residual stream after the block, per token, plus ``final_weight`` times the same
for the final features (``forward_features``; 0 by default: measured, the blocks alone generalise
better). Only the blocks learn, and the final norm when the final features are in the loss; the
embeddings and the head stay as they are (so the teacher can be checked against the student: their
patch embeddings must be equal). AdamW, a linear warmup and a cosine decay. Each step trains on
fresh augmented views of the calibration images' files (:class:`RecoveryImages`: crops, flips,
colour distortions, mixup): the images compression was fitted on are matched closely already, and
views it has not seen carry the signal. The weights measured and kept are a blend, ``blend`` of the
trained change added to compression's (as WiSE-FT interpolates fine-tuned weights): trained on a
few images, the student gains on images like them and loses on others, and the blend keeps most of
the first and gives back the second.

A share of the images' sources is held out for validation, from training and from compression
(:meth:`RecoveryImages.fit_batches`): unseen views of them (at least :data:`VALIDATION_VIEWS` in
all), as they are and distorted in colour and sharpness. The student is measured on both before the
first step and every ``eval_every`` steps (the mean cosine of the model's outputs, pooled features
or logits, to the teacher's). A measurement counts as better when it beats the best so far on the
views as they are (by more than :data:`MIN_GAIN`, float rounding) without falling below compression
on the distorted ones; recovery stops when ``patience`` measurements in a row were not better, and
the weights of the best are kept, CORP's own if none was: a recovery never leaves the model worse
on either validation set than compression left it, and one that kept no step leaves the model
exactly as compression on all the images makes it (:func:`corp_deploy.compress` compresses again
on :attr:`RecoveryImages.batches`).

Under torch.distributed the student is wrapped in ``DistributedDataParallel``: every process draws
the same global batch and runs its share of it, torch averages the gradients, so the result equals
one process's up to the order of float sums.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import distributed
from .calibration import load_rgb, model_transform
from .errors import CorpError, SettingError, check_choice, check_instance, check_setting_types
from .families import blocks_of, family_of, standard_copy
from .methods.base import option

#: The prefix of the recovery's settings where they sit beside the compression's (``recover_steps``).
SETTING_PREFIX = "recover_"
#: The fewest validation views: each held-out source gives ``ceil(VALIDATION_VIEWS / sources)``
#: (a calibration set of a few photos cropped many times holds out one or two of them).
VALIDATION_VIEWS = 32
#: The most bytes of decoded training images (uint8) recovery keeps in memory, so that a step does
#: not decode its files again (decoding 16 photos took 0.25 s of the 0.35 s their views take on one
#: CPU core, and on a GPU a small model's step waits for them); images beyond it are decoded at each use.
DECODED_BYTES = 1 << 30
#: The most images one recovery step may take: DeiT-S keeps over 30 GB of activations for the
#: backward pass at this batch (:func:`corp_deploy.resources.training_bytes`).
MAX_BATCH = 4096
#: The least gain of the validation cosine over the best measurement so far for recovery to keep a
#: step: a smaller one is float32 rounding (a nearly exact compression "gained" 2e-8 and had its
#: weights replaced).
MIN_GAIN = 1e-5
#: The most steps a recovery may take (a million steps of 16 images: days on a GPU; more never ends
#: in practice).
MAX_STEPS = 1_000_000


#: What recovery can train (:attr:`RecoveryConfig.train`), each with its learning rate and blend
#: when those are not given (measured: benchmarks/RESULTS.md, "Recovery"): every parameter of the
#: blocks (and of the final norm, where the loss has the final features), or only their vectors
#: (norm weights and biases, every bias, layer scales: under 1 % of them, which needs a higher rate
#: and little blending to move).
TRAINED: dict[str, dict[str, float]] = {"all": {"lr": 2e-5, "blend": 0.5}, "vectors": {"lr": 5e-4, "blend": 1.0}}


@dataclass(frozen=True)
class RecoveryConfig:
    """How to recover (measured defaults: benchmarks/RESULTS.md, "Recovery").

    Attributes:
        steps: optimisation steps at most; 0 switches recovery off.
        train: which parameters train (:data:`TRAINED`): ``all`` of the blocks (and of the final
            norm, with ``final_weight > 0``), or only their ``vectors`` (norms, biases, layer scales).
        lr: AdamW's peak learning rate (None: ``train``'s, :data:`TRAINED`).
        batch_size: images per step (under torch.distributed: in all, split over the processes).
        weight_decay: AdamW's decoupled weight decay.
        warmup: the fraction of the steps over which the learning rate rises linearly from 0.
        validation: the fraction of the sources held out for validation (rounded; at least one, at
            most half of them and 256).
        eval_every: steps between two validation measurements.
        patience: measurements in a row without improvement after which recovery stops.
        crop_scale: the smallest area of a random resized crop, as a fraction of the image (0.08,
            torchvision's and timm's default: measured, small crops generalise to images unlike
            the training views better than crops of at least a quarter).
        color: the fraction of training views also distorted in colour and sharpness (colour
            jitter, greyscale, blur; :class:`RecoveryImages`).
        mix: the fraction of training views mixed with another view of the batch (mixup: a
            convex combination with a uniform weight; teacher and student see the same mixture).
        blend: the share of the trained change of the weights that is kept: the recovered weights
            are ``compressed + blend * (trained - compressed)`` (1: the trained weights; measured,
            validated and kept as such, as WiSE-FT does for fine-tuned models; None: ``train``'s).
        final_weight: the weight of the final features' term beside the blocks' mean (0: the blocks
            alone, and the final norm does not train).
        pooled_weight: the weight of the pooled output's term beside the blocks' mean (the class
            token or the tokens' mean after the final norm: what a classifier head reads; a norm
            after the pooling, ``fc_norm``, passes the gradient but does not train).
        seed: the seed of the validation split, the batches and the augmentation.
        autocast_bf16: on CUDA, run the forward passes in bfloat16 autocast.
        checkpointing: activation checkpointing (timm's ``set_grad_checkpointing``): each block's
            activations are recomputed in the backward pass instead of kept, for models whose
            training does not fit in memory otherwise.
    """

    steps: int = option(0, "label-free recovery: distillation steps after compression (0: off).")
    train: str = option(
        "all",
        "recovery: which parameters train: all, or vectors (norms, biases, layer scales).",
        choices=tuple(TRAINED),
    )
    lr: float | None = option(
        None, "recovery: AdamW's peak learning rate.", value_type=float, default_help="2e-5 (all), 5e-4 (vectors)"
    )
    batch_size: int = option(16, f"recovery: images per step (at most {MAX_BATCH:,}).")
    weight_decay: float = 0.0
    warmup: float = 0.1
    validation: float = option(
        0.125,
        "recovery: share of the calibration images' source files held out for validation "
        "(rounded; at least one, at most half).",
    )
    eval_every: int = option(25, "recovery: steps between two validation measurements.")
    patience: int = option(4, "recovery: stop after this many measurements without improvement.")
    crop_scale: float = option(0.08, "recovery: smallest random crop, as a fraction of the image.")
    color: float = 0.5
    mix: float = 1.0
    blend: float | None = option(
        None,
        "recovery: share of the trained weight change kept (1: all of it).",
        value_type=float,
        default_help="0.5 (all), 1 (vectors)",
    )
    final_weight: float = 0.0
    pooled_weight: float = 0.0
    seed: int = 0
    autocast_bf16: bool = True
    checkpointing: bool = option(
        False, "recovery: recompute the blocks' activations in the backward pass (less memory)."
    )

    def __post_init__(self) -> None:
        check_setting_types(self, lambda name: SETTING_PREFIX + name)
        check_choice(SETTING_PREFIX + "train", self.train, tuple(TRAINED))
        for name, value in TRAINED[self.train].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        integers = {
            "steps": (0, MAX_STEPS),
            "batch_size": (1, MAX_BATCH),
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
            "validation": (0.0, 0.5, False),  # at least half the sources train
            "crop_scale": (0.0, 1.0, False),
            "color": (0.0, 1.0, True),
            "mix": (0.0, 1.0, True),
            "blend": (0.0, 1.0, False),
            "final_weight": (0.0, 100.0, True),
            "pooled_weight": (0.0, 100.0, True),
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


@dataclass
class Outputs:
    """What the loss compares of one model on a batch: the residual stream after every block (each
    ``(B, N, C)``, or a Swin's ``(B, H, W, C)``), the final features (``forward_features``) and the
    pooled output (``forward_head(..., pre_logits=True)``, ``(B, C)``: what a classifier reads)."""

    blocks: list[torch.Tensor]
    features: torch.Tensor
    pooled: torch.Tensor


def distillation_loss(student: Outputs, teacher: Outputs, final_weight: float, pooled_weight: float) -> torch.Tensor:
    """Mean over blocks of the mean over tokens of ``1 - cos`` between the residual streams
    (cosine over channels), plus ``final_weight`` times the same for the final features and
    ``pooled_weight`` times the mean over images of ``1 - cos`` between the pooled outputs; a
    scalar in float32."""

    def distance(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (1 - F.cosine_similarity(s.float(), t.float(), dim=-1)).mean()

    blocks = torch.stack([distance(s, t) for s, t in zip(student.blocks, teacher.blocks)]).mean()
    return (
        blocks
        + final_weight * distance(student.features, teacher.features)
        + pooled_weight * distance(student.pooled, teacher.pooled)
    )


def _lr_factor(step: int, config: RecoveryConfig) -> float:
    """The learning rate at ``step`` (0-based) as a fraction of ``config.lr``: linear warmup, then cosine."""
    warmup = round(config.warmup * config.steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, config.steps - warmup)))


def trainable_parameters(model: nn.Module, train: str = "all", final_norm: bool = True) -> dict[str, nn.Parameter]:
    """The parameters recovery trains (:data:`TRAINED`), by name: those of the blocks and, with
    ``final_norm`` (the final features are in the loss), of the final norm ``forward_features``
    applies (``norm``; a pooled model's ``fc_norm`` comes after the pooling, outside the loss, and
    does not train), or only the vectors among them (one-dimensional: norm weights and biases,
    biases, layer scales)."""
    owners = [*blocks_of(model), getattr(model, "norm", None) if final_norm else None]
    ids = {id(p) for module in owners if isinstance(module, nn.Module) for p in module.parameters()}
    return {name: p for name, p in model.named_parameters() if id(p) in ids and (train == "all" or p.dim() == 1)}


def check_teacher(student: nn.Module, teacher: nn.Module) -> None:
    """CorpError unless ``teacher`` can be the dense model ``student`` was compressed from: the same
    number of blocks and classes and the same patch embedding (which compression never changes)."""
    if family_of(teacher) is None or not isinstance(getattr(teacher, "patch_embed", None), nn.Module):
        raise CorpError(
            f"the dense model ({type(teacher).__name__}) is not a timm ViT this one could be compressed from"
        )
    if getattr(student, "num_classes", None) != getattr(teacher, "num_classes", None):
        raise CorpError(
            f"the dense model has {teacher.num_classes} classes and the compressed one {student.num_classes}: "
            "it is not the model this one was compressed from"
        )
    if len(blocks_of(student)) != len(blocks_of(teacher)):
        raise CorpError(
            f"the dense model has {len(blocks_of(teacher))} blocks and the compressed one "
            f"{len(blocks_of(student))}: it is not the model this one was compressed from"
        )
    ours, theirs = student.patch_embed.state_dict(), teacher.patch_embed.state_dict()
    if ours.keys() != theirs.keys() or any(not torch.equal(ours[k], theirs[k].to(ours[k].device)) for k in ours):
        raise CorpError(
            "the dense model's patch embedding differs from the compressed model's: these are not the "
            "weights it was compressed from (give the dense model compress started from)"
        )


class RecoveryImages:
    """What recovery trains and validates on, made from the calibration images.

    The images' sources (the file each came from, when the batches say so with an
    ``image_sources`` list, as :class:`~corp_deploy.calibration.CalibrationImages` do; else each
    image is its own source) are split, seeded: a ``validation`` share of the sources (rounded;
    at least one, at most half of them and 256) is held out. Its validation images are views of the
    held-out sources that training does not see (random resized crops, mirrored or not, seeded;
    ``ceil(VALIDATION_VIEWS / sources)`` of each), and the same views distorted once in colour
    and sharpness: a recovery must not buy fidelity on the one by losing it on the other.
    Compression must not see them either (it matches its own calibration images closely, so they
    would flatter it): made before compressing, :meth:`fit_batches` are the images it fits on
    (:attr:`batches`: all of them, as given).
    Training draws fresh augmented views of the other sources: random resized crops of the whole
    file (of the image itself for a bare tensor), mirrored, a ``color`` share of them distorted too
    (colour jitter, greyscale, blur, as self-supervised training augments: SimCLR, DINO), and a
    ``mix`` share mixed with another view (mixup, as function-matching distillation does).

    Args:
        batches: preprocessed images ``(B, 3, H, W)``.
        data_config: the model's timm data config (``mean``, ``std``, ``input_size``).
    """

    def __init__(self, batches: Iterable[torch.Tensor], data_config: dict, config: RecoveryConfig) -> None:
        listed = list(batches)
        if not listed:
            raise CorpError("the calibration set is empty")
        if not all(isinstance(batch, torch.Tensor) and batch.dim() == 4 for batch in listed):
            raise CorpError("calibration batches must be image tensors of shape (B, 3, H, W)")
        images = torch.cat([batch.to(torch.float32) for batch in listed])
        sources = list(getattr(batches, "image_sources", None) or range(len(images)))  # known once read
        distinct = list(dict.fromkeys(sources))
        held = min(256, len(distinct) // 2, max(1, round(config.validation * len(distinct))))  # half train
        if held < 1:
            raise CorpError(
                f"recovery needs calibration images from at least 2 sources (one to train on, one to "
                f"validate); got {len(distinct)}"
            )
        order = torch.randperm(len(distinct), generator=torch.Generator().manual_seed(config.seed)).tolist()
        self.mean = torch.tensor(data_config["mean"]).view(3, 1, 1)
        self.std = torch.tensor(data_config["std"]).view(3, 1, 1)
        kept = [
            source if isinstance(source, Path) else (images[source] * self.std + self.mean).clamp(0, 1)
            for source in (distinct[i] for i in order)
        ]
        self.batches = listed
        self._train, self._held = kept[held:], held
        self._decoded: dict[Path, torch.Tensor] = {}
        trained = {distinct[i] for i in order[held:]}
        self._images, self._batch = images, len(listed[0])
        self._fit = [i for i, source in enumerate(sources) if source in trained]
        self._crop, self._distort = _augmentations(tuple(data_config["input_size"][1:]), config)
        self._seed, self._color, self._mix = config.seed, config.color, config.mix
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            each = math.ceil(VALIDATION_VIEWS / held)
            views = torch.stack(
                [self._crop(self._pixels(source, keep=False)) for source in kept[:held] for _ in range(each)]
            )
            self.validation = (views - self.mean) / self.std
            self.distorted = (torch.stack([self._distort(view) for view in views]) - self.mean) / self.std

    def fit_batches(self) -> list[torch.Tensor]:
        """The calibration images of the training sources, in their order and batch size: what
        compression fits on so that the validation images are unseen by it too."""
        return [self._images[self._fit[i : i + self._batch]] for i in range(0, len(self._fit), self._batch)]

    @property
    def sources(self) -> tuple[int, int]:
        """``(training, validation)`` source counts."""
        return len(self._train), self._held

    def views(self, indices: list[int], step: int) -> torch.Tensor:
        """Augmented views ``(len(indices), 3, H, W)`` of the training sources ``indices``,
        preprocessed; the same for the same ``step`` in every process."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self._seed * 1_000_003 + step)
            views = [self._crop(self._pixels(self._train[i])) for i in indices]
            views = torch.stack([self._distort(v) if torch.rand(1).item() < self._color else v for v in views])
            mixed = torch.rand(len(views)) < self._mix
            weight = torch.where(mixed, torch.rand(len(views)), 1.0).view(-1, 1, 1, 1)
            views = weight * views + (1 - weight) * views.roll(1, dims=0)
        return (views - self.mean) / self.std

    def _pixels(self, source: Path | torch.Tensor, keep: bool = True) -> torch.Tensor:
        """A source (a file or an image) as ``(3, h, w)`` floats in [0, 1]. With ``keep`` (the
        training files) a file is decoded once and kept while the kept files fit in :data:`DECODED_BYTES`."""
        if isinstance(source, torch.Tensor):
            return source
        from torchvision.transforms.v2.functional import pil_to_tensor

        decoded = self._decoded.get(source)
        if decoded is None:
            decoded = pil_to_tensor(load_rgb(source))
            if keep and sum(kept.numel() for kept in self._decoded.values()) + decoded.numel() <= DECODED_BYTES:
                self._decoded[source] = decoded
        return decoded.float() / 255


def _augmentations(size: tuple[int, int], config: RecoveryConfig):
    """The training views' transforms on ``(3, h, w)`` images in [0, 1]: the crop (random resized
    crop to ``size``, mirrored) and the distortion (colour jitter, greyscale, blur)."""
    from torchvision.transforms import v2

    blur = 2 * round(0.05 * max(size)) + 1  # an odd kernel of a tenth of the image (SimCLR)
    crop = v2.Compose(
        [v2.RandomResizedCrop(size, scale=(config.crop_scale, 1.0), antialias=True), v2.RandomHorizontalFlip()]
    )
    distort = v2.Compose(
        [
            v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
            v2.RandomGrayscale(p=0.2),
            v2.RandomApply([v2.GaussianBlur(blur, sigma=(0.1, 2.0))], p=0.5),
        ]
    )
    return crop, distort


class _Distillation:
    """One recovery's training state: the student's trained parameters (the others frozen, their
    ``requires_grad`` given back by :meth:`close`), the optimiser and schedule, the hooks on both
    models' blocks, and the student behind DistributedDataParallel under torch.distributed."""

    def __init__(self, student: nn.Module, teacher: nn.Module, config: RecoveryConfig) -> None:
        self.student, self.teacher, self.config = student, teacher, config
        device = next(student.parameters()).device
        self.bf16 = config.autocast_bf16 and device.type == "cuda"
        if config.checkpointing:
            student.set_grad_checkpointing(True)
        self.trained = trainable_parameters(student, config.train, final_norm=config.final_weight > 0)
        self._requires_grad = {name: p.requires_grad for name, p in student.named_parameters()}
        for name, parameter in student.named_parameters():
            parameter.requires_grad_(name in self.trained)
        self._features = _Features(student)
        if distributed.active():
            self._features = nn.parallel.DistributedDataParallel(self._features)
        self.compressed = self.weights()
        self.optimizer = torch.optim.AdamW(list(self.trained.values()), lr=config.lr, weight_decay=config.weight_decay)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: _lr_factor(step, config))
        self._teacher_blocks, self._student_blocks = _BlockOutputs(teacher), _BlockOutputs(student)

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.bf16 else nullcontext()

    def step(self, x: torch.Tensor, step: int) -> float:
        """One optimisation step on this process's share ``x`` of the batch; the loss, averaged
        over the processes. CorpError if it is not finite."""
        self._teacher_blocks.clear(), self._student_blocks.clear()
        with torch.no_grad(), self.autocast():
            features = self.teacher.forward_features(x)
            teacher = Outputs(
                self._teacher_blocks.outputs, features, self.teacher.forward_head(features, pre_logits=True)
            )
        with self.autocast():
            features = self._features(x)
            student = Outputs(
                self._student_blocks.outputs, features, self.student.forward_head(features, pre_logits=True)
            )
        loss = distillation_loss(student, teacher, self.config.final_weight, self.config.pooled_weight)
        if not torch.isfinite(loss):
            raise CorpError(
                f"recovery stopped at step {step} of {self.config.steps}: the loss is not finite "
                f"({float(loss.detach())}); nothing was written (try a lower --recover-lr)"
            )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.schedule.step()
        return distributed.sum_floats(float(loss.detach()))[0] / distributed.world_size()

    @torch.no_grad()
    def reference(self, images: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This process's share of ``images`` (under torch.distributed), in batches, each with the
        teacher's outputs on it (pooled features or logits): what :meth:`validate` compares with."""
        device = next(self.student.parameters()).device
        share = images[distributed.rank() :: distributed.world_size()]
        batches = [
            share[i : i + self.config.batch_size].to(device) for i in range(0, len(share), self.config.batch_size)
        ]
        with self.autocast():
            return [(x, self.teacher(x).float().flatten(1)) for x in batches]

    @torch.no_grad()
    def validate(self, reference: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean over the images of ``reference`` (:meth:`reference`) of the cosine between the
        student's outputs and the teacher's; under torch.distributed the processes' sums are added."""
        cosines, count = 0.0, 0
        for x, target in reference:
            with self.autocast():
                output = self.student(x).float().flatten(1)
            cosines += float(F.cosine_similarity(output, target, dim=1).double().sum())
            count += len(x)
        cosines, count = distributed.sum_floats(cosines, count)
        return cosines / count

    @contextmanager
    def blended(self):
        """The student with the recovered weights (``config.blend`` of the trained change kept)
        for the ``with`` block, which is given a copy of them; the trained weights after it."""
        trained = self.weights()
        with torch.no_grad():
            for name, parameter in self.trained.items():
                parameter.copy_(self.compressed[name] + self.config.blend * (trained[name] - self.compressed[name]))
        try:
            yield self.weights()
        finally:
            with torch.no_grad():
                for name, parameter in self.trained.items():
                    parameter.copy_(trained[name])

    def weights(self) -> dict[str, torch.Tensor]:
        """A copy of the trained parameters."""
        return {name: p.detach().clone() for name, p in self.trained.items()}

    def close(self, weights: dict[str, torch.Tensor]) -> None:
        """Put ``weights`` into the student, remove the hooks, give back ``requires_grad``."""
        with torch.no_grad():
            for name, parameter in self.trained.items():
                parameter.copy_(weights[name])
        self._teacher_blocks.remove(), self._student_blocks.remove()
        if self.config.checkpointing:
            self.student.set_grad_checkpointing(False)
        for name, parameter in self.student.named_parameters():
            parameter.requires_grad_(self._requires_grad[name])


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
    :func:`~corp_deploy.families.standard_copy`) on ``images``, as the module docstring says:
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
    references = run.reference(images.validation), run.reference(images.distorted)

    def measure(step: int) -> tuple[float, float, dict[str, torch.Tensor]]:
        with run.blended() as weights:
            cosine, distorted = (run.validate(reference) for reference in references)
            if on_measure is not None:
                on_measure(step, student)
        return cosine, distorted, weights

    start_cosine, start_distorted, weights = measure(0)
    best = {"step": 0, "cosine": start_cosine, "distorted": start_distorted, "weights": weights}
    curve = [{"step": 0, "loss": None, "validation_cosine": start_cosine, "distorted_cosine": start_distorted}]
    stop, running, stale, step = "steps done", None, 0, 0
    order = _Batches(images.sources[0], config.batch_size, torch.Generator().manual_seed(config.seed + 1))
    try:
        with _Progress(progress, config.steps, start_cosine) as bar:
            for step in range(1, config.steps + 1):
                loss = run.step(images.views(order.next(), step)[distributed.rank() :: world].to(device), step)
                running = loss if running is None else 0.9 * running + 0.1 * loss
                bar.step(running)
                if step % config.eval_every and step != config.steps:
                    continue
                cosine, distorted, weights = measure(step)
                curve.append(
                    {"step": step, "loss": running, "validation_cosine": cosine, "distorted_cosine": distorted}
                )
                bar.validated(cosine)
                better = cosine > best["cosine"] + MIN_GAIN and distorted >= start_distorted
                stale = 0 if better else stale + 1
                if better:
                    best = {"step": step, "cosine": cosine, "distorted": distorted, "weights": weights}
                if stale >= config.patience:
                    plural = "s" if config.patience > 1 else ""
                    stop = f"validation did not improve in {config.patience} measurement{plural}"
                    break
    finally:
        run.close(best["weights"])
    return {
        "settings": asdict(config),
        "images": {
            "training_sources": images.sources[0],
            "validation_sources": images.sources[1],
            "validation_views": len(images.validation),
        },
        "steps_run": step,
        "stopped": stop,
        "best_step": best["step"],
        "validation_cosine": {"compressed": start_cosine, "recovered": best["cosine"]},
        "distorted_validation_cosine": {"compressed": start_distorted, "recovered": best["distorted"]},
        "curve": curve,
        "trained_parameters": sum(p.numel() for p in run.trained.values()),
        "time_s": round(time.perf_counter() - started, 2),
        "bf16_autocast": run.bf16,
    }


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
    """Progress on stderr: on a terminal a bar with the steps, the running loss, the last validation
    cosine and the time left; elsewhere (a CI log) one line per validation measurement."""

    def __init__(self, enabled: bool, steps: int, start_cosine: float) -> None:
        self._bar = self._console = None
        self._steps, self._done, self._loss, self._started = steps, 0, float("nan"), time.perf_counter()
        if not enabled:
            return
        from rich.console import Console

        console = Console(stderr=True)
        if not console.is_terminal:
            self._console = console
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(
            TextColumn("recovering"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  validation cosine {task.fields[cosine]}"),
            TimeRemainingColumn(),
            console=console,
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
        self._done, self._loss = self._done + 1, loss
        if self._bar is not None:
            self._bar.update(self._task, advance=1, loss=f"{loss:.4f}")

    def validated(self, cosine: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, cosine=f"{cosine:.4f}")
        elif self._console is not None:
            elapsed = time.perf_counter() - self._started
            left = elapsed / self._done * (self._steps - self._done)
            self._console.print(
                f"recovering: step {self._done}/{self._steps}, loss {self._loss:.4f}, validation cosine "
                f"{cosine:.4f}, {elapsed:.0f} s so far, about {left:.0f} s left",
                highlight=False,
                soft_wrap=True,
            )


def recovery_table(report: dict, path=None):
    """A recovery's report (:func:`recover`) as a rich table: steps run and why it stopped, the
    best step, the validation cosine before and after (only before, when no step was kept), and the time."""
    from rich.table import Table

    kept = report["best_step"]

    def change(cosines: dict) -> str:
        before = f"{cosines['compressed']:.4f}"
        return f"{before} -> {cosines['recovered']:.4f}" if kept else f"{before} (before any step)"

    table = Table(title="recovery" + (f" -> {path}" if path else ""))
    table.add_column("")
    table.add_column("", justify="right")
    table.add_row("steps run", f"{report['steps_run']} ({report['stopped']})")
    table.add_row("weights kept from step", str(kept) if kept else "none: no measurement beat compression's")
    images = report["images"]
    table.add_row(
        f"validation output cosine ({images['validation_views']} views of "
        f"{images['validation_sources']} held-out image{'s' if images['validation_sources'] != 1 else ''})",
        change(report["validation_cosine"]),
    )
    table.add_row("the same images distorted (colour, greyscale, blur)", change(report["distorted_validation_cosine"]))
    table.add_row("recovery wall time (s)", f"{report['time_s']:.1f}")
    return table
