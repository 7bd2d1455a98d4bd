"""Recovery's settings: :class:`RecoveryConfig`, what can train (:data:`TRAINED`) and the bounds of
the settings."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from ..errors import SettingError, check_choice, check_setting_types
from ..methods.base import option

#: The prefix of the recovery's settings where they sit beside the compression's (``recover_steps``).
SETTING_PREFIX = "recover_"
#: The most images one recovery step may take: DeiT-S keeps over 30 GB of activations for the
#: backward pass at this batch (:func:`corp_deploy.resources.training_bytes`).
MAX_BATCH = 4096
#: The most steps a recovery may take (a million steps of 16 images: days on a GPU; more never ends
#: in practice).
MAX_STEPS = 1_000_000
#: The most DataLoader workers recovery may start for its training views.
MAX_WORKERS = 64


#: What recovery can train (:attr:`RecoveryConfig.train`), each with its learning rate when none is
#: given (measured: lab/RESULTS.md, "Recovery"): every parameter of the blocks (and of the
#: final norm, where the loss has the final features), or only their vectors (norm weights and
#: biases, every bias, layer scales: under 1 % of them, which needs a higher rate to move).
TRAINED: dict[str, dict[str, float]] = {"all": {"lr": 2e-5}, "vectors": {"lr": 5e-4}}


@dataclass(frozen=True)
class RecoveryConfig:
    """How to recover (measured defaults: lab/RESULTS.md, "Recovery").

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
            jitter, greyscale, blur; :class:`RecoveryImages`). 0 by default: on the photo set's
            171 training sources the plain views (no colour, no mixup, blend 1) gained more than
            half distorted and all mixed (lab/RESULTS.md, "Recovery on the photo set"); on
            9 photos the distortions had helped on images unlike them.
        mix: the fraction of training views mixed with another view of the batch (mixup: a
            convex combination with a uniform weight; teacher and student see the same mixture).
        blend: the share of the trained change of the weights that is kept: the recovered weights
            are ``compressed + blend * (trained - compressed)`` (1: the trained weights, the
            default; 0.5, as WiSE-FT does for fine-tuned models, served 9 training photos better,
            and many sources less).
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
        workers: DataLoader worker processes that make the training views ahead of the steps (0: the
            main process makes each step's views when it needs them); the views are the same whatever
            the number.
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
    color: float = 0.0
    mix: float = 0.0
    blend: float = option(1.0, "recovery: share of the trained weight change kept (1: all of it).")
    final_weight: float = 0.0
    pooled_weight: float = 0.0
    seed: int = 0
    autocast_bf16: bool = True
    checkpointing: bool = option(
        False, "recovery: recompute the blocks' activations in the backward pass (less memory)."
    )
    workers: int = option(2, f"recovery: worker processes making the training views (0 to {MAX_WORKERS}).")

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
            "seed": (0, 2**32 - 1),  # as compress's seed (every random generator used takes it)
            "workers": (0, MAX_WORKERS),
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
