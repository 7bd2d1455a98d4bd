"""Held-out evaluation images for ``bench``: a folder, labelled or not, or the bundled photos.

A folder is **labelled** when it holds ``class_index.json``, a JSON object mapping each
class sub-folder name to the model's output index (ImageFolder layout)::

    val/class_index.json        {"n01440764": 0, "n01443537": 1, ...}
    val/n01440764/*.JPEG
    val/n01443537/*.JPEG

Otherwise every image under it (recursively) is used without labels. Either way, files that
cannot be read as images are skipped and counted (``description["files_skipped"]``), and what
makes the images a poor measure (images of one colour, near-identical images, images without
detail: :meth:`~corp_deploy.calibration.ImageSpan.warnings`) is said on stderr and recorded in
``description["warnings"]``, so that the report a CI job reads says it too.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from corp_deploy import CalibrationImages, CorpError
from corp_deploy.calibration import (
    HELD_OUT_PHOTOS,
    UNREADABLE,
    ImageSpan,
    file_digest,
    find_images,
    held_out_images,
    load_rgb,
    pixel_digest,
    unreadable_reason,
    warn_once,
)
from corp_deploy.files import existing_dir

CLASS_INDEX_FILE = "class_index.json"


@dataclass
class EvalImages:
    """Batches of ``(images (B, 3, H, W) float32, labels (B,) int64 or None)``.

    ``description`` says where the images come from; ``labelled`` whether labels exist;
    ``digests`` and ``pixel_digests``, once iterated, the :func:`~corp_deploy.calibration.file_digest`
    and the :func:`~corp_deploy.calibration.pixel_digest` of each file a folder's images came from
    (empty for the bundled photos).
    """

    batches: Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor | None]]]
    description: dict
    labelled: bool
    digests: set[str] = field(default_factory=set)
    pixel_digests: set[str] = field(default_factory=set)

    def __iter__(self):
        return self.batches()


def eval_images(
    data: str | Path | None, transform: Callable, *, limit: int, batch_size: int = 32, seed: int = 0
) -> EvalImages:
    """The evaluation set: ``data`` (a folder, see the module docstring) or, when None,
    ``limit`` seeded crops of the bundled photos that are kept out of calibration splits."""
    if data is None:
        images = held_out_images(transform, limit, batch_size, seed)
        return EvalImages(
            lambda: ((x, None) for x in images),
            {"source": "builtin", "photos": list(HELD_OUT_PHOTOS), "images": limit},
            False,
        )
    root = existing_dir(data, "evaluation data directory")
    if not (root / CLASS_INDEX_FILE).is_file():
        images = CalibrationImages.from_directory(
            root, transform, limit=limit, batch_size=batch_size, seed=seed, purpose="evaluation"
        )
        description = {"source": "directory", "path": str(root), "labelled": False}
        digests, pixels = set(), set()
        return EvalImages(lambda: _described(images, description, digests, pixels), description, False, digests, pixels)
    mapping, samples = labelled_samples(root)
    random.Random(seed).shuffle(samples)
    samples = samples[:limit]
    description = {
        "source": "directory",
        "path": str(root),
        "labelled": True,
        "images": len(samples),
        "classes": len(mapping),
        "highest_label": max(mapping.values()),
    }
    digests, pixels, said = set(), set(), set()
    return EvalImages(
        lambda: _labelled_batches(samples, transform, batch_size, description, digests, pixels, said),
        description,
        True,
        digests,
        pixels,
    )


def read_class_index(root: Path) -> dict[str, int]:
    """``class_index.json`` of ``root``: class folder name -> output index (an int >= 0)."""
    path = root / CLASS_INDEX_FILE
    try:
        mapping = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CorpError(f"cannot read {path}: {exc}") from None
    if (
        not isinstance(mapping, dict)
        or not mapping
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in mapping.values())
    ):
        raise CorpError(f"{path} must be a JSON object mapping class folder names to output indices (ints >= 0)")
    return mapping


def labelled_samples(root: Path) -> tuple[dict[str, int], list[tuple[Path, int]]]:
    """The class index and every ``(image path, label)`` of a labelled folder, sorted. CorpError
    unless every class folder is in ``class_index.json`` and every entry there is a folder. Hidden
    folders (``.ipynb_checkpoints``) are class folders only when the index names them."""
    mapping = read_class_index(root)
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and (p.name in mapping or not p.name.startswith(".")))
    unknown = [name for name in folders if name not in mapping]
    if unknown:
        raise CorpError(f"class folders missing from {root / CLASS_INDEX_FILE}: {unknown[:5]}")
    absent = [name for name in mapping if name not in folders]
    if absent:
        raise CorpError(f"{root / CLASS_INDEX_FILE} names classes that have no folder under {root}: {absent[:5]}")
    samples = [(path, mapping[name]) for name in folders for path in find_images(root / name)]
    if not samples:
        raise CorpError(f"no images found in the class folders under {root}")
    return mapping, samples


def check_labels(evaluation: EvalImages, num_classes: int) -> None:
    """CorpError when a labelled evaluation set names an output the model does not have."""
    if not evaluation.labelled:
        return
    index = Path(evaluation.description["path"]) / CLASS_INDEX_FILE
    if num_classes == 0:
        raise CorpError(
            f"{index} labels the images, but the model has no classifier to score them against; "
            "leave class_index.json out to measure feature fidelity"
        )
    top = evaluation.description["highest_label"]
    if top >= num_classes:
        raise CorpError(f"{index} maps a class to output {top}, but the model has {num_classes} outputs")


def _described(images: CalibrationImages, description: dict, digests: set[str], pixels: set[str]):
    """Unlabelled batches; afterwards ``description`` counts the images used and the files skipped,
    and ``digests`` and ``pixels`` hold the used files' digests (of their bytes, of their pixels)."""
    for x in images:
        yield x, None
    digests.update(images.digests())
    pixels.update(images.pixel_digests())
    summary = images.summary()
    description.update(
        images=summary["images_used"],
        files_skipped=summary["files_skipped"],
        skipped_examples=summary["skipped_examples"],
        warnings=images.span.warnings() + images.copies_warnings(),
    )


def _labelled_batches(
    samples: list[tuple[Path, int]],
    transform: Callable,
    batch_size: int,
    description: dict,
    digests: set[str],
    pixels: set[str],
    said: set[str],
):
    """Labelled batches; afterwards ``description`` counts the images used and the files skipped,
    and ``digests`` and ``pixels`` hold the used files' digests (of their bytes, of their pixels).
    The images' warnings are given once (``said``: those given by earlier iterations)."""
    images, labels, skipped, span = [], [], [], ImageSpan("evaluation")
    for path, label in samples:
        try:
            decoded = load_rgb(path)
            image, digest, pixel = transform(decoded), file_digest(path), pixel_digest(decoded)
        except UNREADABLE as exc:
            skipped.append(unreadable_reason(path, exc))
            continue
        images.append(image)
        digests.add(digest)
        pixels.add(pixel)
        labels.append(label)
        if len(images) == batch_size:
            yield _spanned(torch.stack(images), span), torch.tensor(labels)
            images, labels = [], []
    if images:
        yield _spanned(torch.stack(images), span), torch.tensor(labels)
    if len(skipped) == len(samples):
        raise CorpError(f"none of the {len(samples)} evaluation images could be read (e.g. {skipped[0]})")
    warn_once(span.warnings(), said)
    description.update(
        images=len(samples) - len(skipped),
        files_skipped=len(skipped),
        skipped_examples=skipped[:5],
        warnings=span.warnings(),
    )


def _spanned(batch: torch.Tensor, span: ImageSpan) -> torch.Tensor:
    """``batch``, added to ``span``."""
    span.add(batch)
    return batch


def folders_overlap(first: str | Path, second: str | Path) -> bool:
    """Whether two image folders, each read recursively, can share files: the same folder (after
    resolving links) or one inside the other."""
    first, second = Path(first).resolve(), Path(second).resolve()
    return first == second or first in second.parents or second in first.parents
