"""The photo set's images (:mod:`lab.photo_set`) as the studies calibrate and measure on them.

Calibration takes the first ``photos`` of the training split in a seeded order (so 10 photos are among
the 50, the 50 among the 150), each as ``views`` images: the file as the model sees it (resize and
centre crop) and ``views - 1`` seeded random crops and flips of it (25-100 % of the area, as the
bundled photos are cropped). Evaluation takes every file of a split (``held_out``: photos like the
training ones, from other sources; ``unlike``: a package held out whole), each as the file itself and
``views - 1`` seeded crops. Every image records its source file (``image_sources``), as
:class:`~corp_deploy.calibration.CalibrationImages` does, so that recovery splits by source.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from corp_deploy.calibration import load_rgb, random_crop_flip
from lab.photo_set import PhotoSet


class SetImages:
    """Preprocessed batches ``(B, 3, H, W)`` of some of the set's files, held in memory; iterating
    gives the same batches, ``image_sources`` the file of each image in order."""

    def __init__(self, paths: list[Path], transform: Callable, views: int, seed: int, batch_size: int = 32) -> None:
        if views < 1:
            raise ValueError(f"views must be >= 1, got {views}")
        rng = random.Random(seed)
        images, self.image_sources = [], []
        for path in paths:
            image = load_rgb(path)
            for view in range(views):
                images.append(transform(image if view == 0 else random_crop_flip(image, rng)))
                self.image_sources.append(path)
        self._batches = [torch.stack(images[i : i + batch_size]) for i in range(0, len(images), batch_size)]
        self.files = len(paths)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._batches)

    def __len__(self) -> int:
        return len(self.image_sources)

    def summary(self) -> dict:
        return {"source": "photo set", "files": self.files, "used": len(self)}


def training_photos(root: Path, photos: int | None, seed: int = 0) -> list[Path]:
    """The first ``photos`` files of the training split in a seeded order (None: all of them)."""
    paths = PhotoSet(root).paths("train")
    random.Random(seed).shuffle(paths)
    if photos is not None and photos > len(paths):
        raise SystemExit(f"the set's training split holds {len(paths)} photos, not {photos}")
    return paths[:photos]


def calibration_images(
    root: Path, transform: Callable, photos: int | None, views: int, seed: int = 0, batch_size: int = 32
) -> SetImages:
    """:func:`training_photos`, each as ``views`` images (the file itself, then seeded crops)."""
    return SetImages(training_photos(root, photos, seed), transform, views, seed, batch_size)


def evaluation_images(root: Path, split: str, transform: Callable, views: int = 3, seed: int = 1) -> SetImages:
    """Every file of ``split`` as ``views`` images (the file itself, then seeded crops)."""
    return SetImages(PhotoSet(root).paths(split), transform, views, seed)
