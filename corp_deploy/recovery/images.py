"""What recovery trains and validates on (:class:`RecoveryImages`: the split of the calibration
images' sources, the held-out validation views, the augmented training views) and the order of the
training batches (:class:`_Batches`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import torch
from torchvision.transforms import v2
from torchvision.transforms.v2.functional import pil_to_tensor

from ..calibration import load_rgb
from ..errors import CorpError
from .config import RecoveryConfig

#: The fewest validation views: each held-out source gives ``ceil(VALIDATION_VIEWS / sources)``
#: (a calibration set of a few photos cropped many times holds out one or two of them).
VALIDATION_VIEWS = 32
#: The most bytes of decoded training images (uint8) recovery keeps in memory, so that a step does
#: not decode its files again (decoding 16 photos took 0.25 s of the 0.35 s their views take on one
#: CPU core, and on a GPU a small model's step waits for them); images beyond it are decoded at each use.
DECODED_BYTES = 1 << 30


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
        decoded = self._decoded.get(source)
        if decoded is None:
            decoded = pil_to_tensor(load_rgb(source))
            if keep and sum(kept.numel() for kept in self._decoded.values()) + decoded.numel() <= DECODED_BYTES:
                self._decoded[source] = decoded
        return decoded.float() / 255


def _augmentations(size: tuple[int, int], config: RecoveryConfig):
    """The training views' transforms on ``(3, h, w)`` images in [0, 1]: the crop (random resized
    crop to ``size``, mirrored) and the distortion (colour jitter, greyscale, blur)."""
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
