"""The photos bundled inside scikit-image's package data (no download needed): their names, split so
that evaluation (``corp-deploy bench``) can use photos calibration never saw, and their paths.
Apart from :mod:`corp_deploy.calibration` so that what only needs the names does not import torch."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .errors import CorpError

BUILTIN_PHOTOS = (
    "astronaut.png",
    "chelsea.png",
    "coffee.png",
    "rocket.jpg",
    "motorcycle_left.png",
    "motorcycle_right.png",
    "hubble_deep_field.jpg",
    "retina.jpg",
    "ihc.png",
    "camera.png",
    "coins.png",
    "moon.png",
    "brick.png",
    "grass.png",
    "gravel.png",
)
HELD_OUT_PHOTOS = ("astronaut.png", "coffee.png", "motorcycle_right.png", "coins.png", "grass.png")
CALIBRATION_PHOTOS = tuple(p for p in BUILTIN_PHOTOS if p not in HELD_OUT_PHOTOS)


def builtin_photo_paths(names: Sequence[str] = BUILTIN_PHOTOS) -> list[Path]:
    """Paths of scikit-image's bundled photos."""
    import skimage.data

    folder = Path(skimage.data.__file__).parent
    paths = [folder / n for n in names]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise CorpError(f"scikit-image does not ship the photos {missing}; use --calib DIR")
    return paths
