"""Held-out evaluation images for ``bench``: a folder, labelled or not, or the bundled photos.

A folder is **labelled** when it holds ``class_index.json``, a JSON object mapping each
class sub-folder name to the model's output index (ImageFolder layout)::

    val/class_index.json        {"n01440764": 0, "n01443537": 1, ...}
    val/n01440764/*.JPEG
    val/n01443537/*.JPEG

Otherwise every image under it (recursively) is used without labels.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from PIL import UnidentifiedImageError

from corp_deploy import CalibrationImages, CorpError
from corp_deploy.calibration import HELD_OUT_PHOTOS

from .fidelity import held_out_images

CLASS_INDEX_FILE = "class_index.json"


@dataclass
class EvalImages:
    """Batches of ``(images (B, 3, H, W) float32, labels (B,) int64 or None)``.

    ``description`` says where the images come from; ``labelled`` whether labels exist.
    """

    batches: Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor | None]]]
    description: dict
    labelled: bool

    def __iter__(self):
        return self.batches()


def eval_images(data: str | Path | None, transform: Callable, *, limit: int, batch_size: int = 32,
                seed: int = 0) -> EvalImages:
    """The evaluation set: ``data`` (a folder, see the module docstring) or, when None,
    ``limit`` seeded crops of the bundled photos that are kept out of calibration splits."""
    if data is None:
        images = held_out_images(transform, limit, batch_size, seed)
        return EvalImages(lambda: ((x, None) for x in images),
                          {"source": "builtin", "photos": list(HELD_OUT_PHOTOS), "images": limit}, False)
    root = Path(data)
    if not root.is_dir():
        raise CorpError(f"evaluation data directory not found: {root}")
    if not (root / CLASS_INDEX_FILE).is_file():
        images = CalibrationImages.from_directory(root, transform, limit=limit, batch_size=batch_size, seed=seed)
        return EvalImages(lambda: ((x, None) for x in images),
                          {"source": "directory", "path": str(root), "labelled": False}, False)
    dataset = labelled_dataset(root, transform)
    order = list(range(len(dataset)))
    random.Random(seed).shuffle(order)
    subset = torch.utils.data.Subset(dataset, order[:limit])
    return EvalImages(lambda: _checked(torch.utils.data.DataLoader(subset, batch_size=batch_size), root),
                      {"source": "directory", "path": str(root), "labelled": True, "images": len(subset),
                       "classes": len(dataset.classes)}, True)


def labelled_dataset(root: Path, transform: Callable):
    """torchvision's ``ImageFolder`` over ``root`` with targets mapped through ``class_index.json``."""
    from torchvision.datasets import ImageFolder
    try:
        mapping = json.loads((root / CLASS_INDEX_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CorpError(f"cannot read {root / CLASS_INDEX_FILE}: {exc}") from None
    if not isinstance(mapping, dict) or not all(isinstance(v, int) and v >= 0 for v in mapping.values()):
        raise CorpError(f"{root / CLASS_INDEX_FILE} must map class folder names to output indices (ints >= 0)")
    try:
        dataset = ImageFolder(str(root), transform=transform)
    except (FileNotFoundError, OSError) as exc:
        raise CorpError(f"{root} is not an ImageFolder layout: {exc}") from None
    unknown = [name for name in dataset.classes if name not in mapping]
    if unknown:
        raise CorpError(f"class folders missing from {root / CLASS_INDEX_FILE}: {unknown[:5]}")
    dataset.target_transform = lambda index: mapping[dataset.classes[index]]
    return dataset


def _checked(loader, root: Path):
    try:
        yield from loader
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as exc:
        raise CorpError(f"cannot read an evaluation image under {root}: {exc}") from None
