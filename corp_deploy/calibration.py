"""Unlabelled calibration images, preprocessed exactly as the model expects at inference."""

from __future__ import annotations

import hashlib
import math
import numbers
import os
import random
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from .bundled_photos import CALIBRATION_PHOTOS, HELD_OUT_PHOTOS, builtin_photo_paths
from .errors import CorpError, SettingError, check_instance, check_setting_types, described, first_line
from .files import checked_path, existing_dir, shown
from .outputs import RECORD_FILE

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
#: How many calibration images compress, sweep and an int8 export use unless told otherwise.
DEFAULT_IMAGES = 256
#: The most images a calibration or evaluation set may be asked for (``--calib-samples``, ``--data-samples``).
MAX_IMAGES = 10_000_000
#: How many calibration images are preprocessed and run at once unless told otherwise.
DEFAULT_BATCH = 32
#: The crops the bundled photos, and a directory of fewer files than the images asked for, are
#: calibrated on (:func:`random_crop_flip`).
CROPS = "seeded random resized crops (scale 0.25-1) and horizontal flips"


def find_images(directory: str | Path) -> list[Path]:
    """Entries under ``directory`` named as images (recursive, links to folders followed, each folder
    once; sorted; by extension), folders excepted: regular files, and dangling links or special files
    (FIFOs, devices), which :func:`load_rgb` refuses, so that they are counted as unreadable rather
    than left out unsaid. Hidden entries (a name starting with ``.``, or inside such a folder:
    ``.ipynb_checkpoints``, ``.thumbnails``, macOS's ``._*`` files) are not images of the set, nor
    are the files of corp-deploy's own outputs below it (a folder holding a ``RECORD_FILE``: a
    bench report's plot is no photo). CorpError naming it for a link that leads up the tree
    (:func:`_up_the_tree`): ``..``, ``~`` or ``/`` would make everything beside the folder images of it."""
    root = existing_dir(directory, "image directory")
    found, seen = [], set()
    for folder, subfolders, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:  # a link back up the tree, or a second link to one folder
            subfolders.clear()
            continue
        seen.add(real)
        if folder != str(root) and os.path.isfile(os.path.join(folder, RECORD_FILE)):
            subfolders.clear()  # an output of corp-deploy: its files are not images of the set
            continue
        subfolders[:] = [name for name in subfolders if not name.startswith(".")]
        for name in subfolders:
            _check_link(Path(folder, name), real, root)
        found += [
            Path(folder, name)
            for name in files
            if not name.startswith(".") and Path(name).suffix.lower() in IMAGE_EXTENSIONS
        ]
    return sorted(found)


def _check_link(path: Path, folder: str, root: Path) -> None:
    """CorpError naming ``path`` (a sub-folder of ``folder``, resolved, as the walk of ``root`` meets
    it) when it is a link that leads up the tree (:func:`_up_the_tree`)."""
    if path.is_symlink() and _up_the_tree(Path(os.path.realpath(path)), Path(folder), root):
        raise CorpError(
            f"{shown(path)} is a link to {shown(os.path.realpath(path))}, a folder that holds the folder the link "
            f"is in: reading {shown(root)} would take in everything beside it; remove the link, or link to a "
            "folder of images"
        )


def _up_the_tree(target: Path, folder: Path, root: Path) -> bool:
    """Whether a link in ``folder`` (resolved) that resolves to ``target`` leads up the tree: to a
    folder that holds ``folder``, outside ``root`` (the image directory, resolved). A link to a folder
    elsewhere, or back to a folder of ``root`` (walked once), is followed."""
    return not target.is_relative_to(root) and folder.is_relative_to(target)


#: Why an image file cannot be used: the errors Pillow raises for unreadable, truncated,
#: unsupported or oversized ("decompression bomb") files.
UNREADABLE = (
    OSError,
    UnidentifiedImageError,
    ValueError,
    SyntaxError,
    MemoryError,
    Image.DecompressionBombError,
    Image.DecompressionBombWarning,
)


def load_rgb(path: str | Path) -> Image.Image:
    """An image file as 8-bit RGB, upright: turned by its EXIF orientation as a viewer shows it (a
    camera's portrait photo is stored sideways with an orientation tag). 16-bit and 32-bit integer
    greyscale is scaled to 8 bits (not clipped, which would turn it white). Raises one of
    :data:`UNREADABLE`; an image above Pillow's pixel limit (``Image.MAX_IMAGE_PIXELS``) is refused
    before it is decoded, and anything but a regular file (or a link to one) before it is opened:
    Pillow would wait forever on a FIFO. The one loader of calibration, evaluation and recovery images."""
    if not Path(path).is_file():
        raise OSError("not a regular file (a dangling link, FIFO or device)")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with Image.open(path) as image:
            ImageOps.exif_transpose(image, in_place=True)
            if image.mode.startswith("I;16") or image.mode == "I":
                levels = np.asarray(image, dtype=np.float64)
                if image.mode != "I" or levels.max(initial=0) > 255:
                    levels = levels / 257.0
                return Image.fromarray(np.clip(levels.round(), 0, 255).astype(np.uint8), "L").convert("RGB")
            return image.convert("RGB")


def file_digest(path: str | Path) -> str:
    """A short digest of a file's bytes (BLAKE2b, 8 bytes, hex): equal for byte-identical copies,
    whatever their names. What artifacts record as ``image_digests``; sources are compared by
    :func:`pixel_digest`, which also finds a copy saved in another format."""
    return hashlib.blake2b(Path(path).read_bytes(), digest_size=8).hexdigest()


def pixel_digest(image: Image.Image) -> str:
    """A short digest of an image's pixels as :func:`load_rgb` decodes them (BLAKE2b, 8 bytes, hex, of
    the shape and the 8-bit RGB values): equal for files of identical pixels, whatever their names,
    formats and encodings (a PNG and its lossless WebP, BMP or TIFF, a PNG saved at another
    compression level). Only identical pixels are recognised: a lossy re-encoding (another JPEG
    quality), a resize or a crop gives another digest. How calibration, recovery and ``bench`` tell
    images apart (recorded by artifacts as ``pixel_digests``)."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    digest = hashlib.blake2b(f"{rgb.height}x{rgb.width}x3\n".encode(), digest_size=8)
    digest.update(rgb.tobytes())
    return digest.hexdigest()


#: What compression and recovery take as their images, as messages name it.
BATCHES = "an iterable of preprocessed image batches, tensors (B, 3, H, W)"


def check_batch(images: object) -> None:
    """CorpError unless ``images`` is a batch of preprocessed images, as compression and recovery take
    them: a floating-point ``(B, 3, H, W)`` tensor (normalised pixels, not uint8), every value finite."""
    if not isinstance(images, torch.Tensor) or images.ndim != 4:
        raise CorpError("calibration batches must be image tensors of shape (B, 3, H, W)")
    if not images.is_floating_point():
        raise CorpError(
            f"calibration batches must be preprocessed (normalised, floating-point) images; got {images.dtype}"
        )
    if not torch.isfinite(images).all():
        raise CorpError("calibration batch contains NaN or infinite values")


def unreadable_reason(path: Path, exc: BaseException) -> str:
    """``name: why`` for a skipped image file, in one line."""
    if isinstance(exc, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        why = f"larger than {Image.MAX_IMAGE_PIXELS} pixels (decompression-bomb limit)"
    elif isinstance(exc, UnidentifiedImageError):
        why = "not an image Pillow can read"
    else:
        why = first_line(exc, 120)
    return f"{shown(path)}: {why}"


#: How much a calibration set must vary, across its images and within each, in units of the model's
#: input normalisation (the bundled photos: about 1.0 across, 0.7 within, :class:`ImageSpan`), not
#: to be warned about: a tenth of what photos give.
LOW_SPAN = 0.1
#: A spatial standard deviation this small is an image of one colour (float rounding of a constant).
_CONSTANT = 1e-6


class ImageSpan:
    """How much a set of preprocessed images varies, streamed batch by batch (``add``, each batch
    ``(B, C, H, W)``), in units of the model's input normalisation:

    - ``across``: the root mean square over input values of their standard deviation across the
      images (copies of one image, or near-identical ones: about 0; the bundled photos: about 1.0);
    - ``within``: the mean over images and channels of the standard deviation over an image's
      pixels (an image of one colour: 0; the bundled photos: about 0.7);
    - ``constant``: how many images are of one colour (every channel constant).

    ``purpose``: what the images are for, as messages name them ("calibration", "evaluation").
    """

    def __init__(self, purpose: str = "calibration") -> None:
        self.purpose = purpose
        self.images = self.constant = 0
        self._within = 0.0
        self._sum: torch.Tensor | None = None
        self._squares: torch.Tensor | None = None

    def add(self, batch: torch.Tensor) -> None:
        for image in batch.detach():  # one image in float64 at a time
            x = image.to("cpu", torch.float64)
            if self._sum is None:
                self._sum, self._squares = torch.zeros_like(x), torch.zeros_like(x)
            self._sum += x
            self._squares.addcmul_(x, x)
            spatial = x.flatten(1).std(1, unbiased=False)  # per channel
            self._within += float(spatial.mean())
            self.constant += bool(spatial.max() < _CONSTANT)
            self.images += 1

    @property
    def across(self) -> float:
        if not self.images:
            return 0.0
        mean = self._sum / self.images
        return float((self._squares / self.images - mean.square()).clamp_min(0).mean().sqrt())

    @property
    def within(self) -> float:
        return self._within / self.images if self.images else 0.0

    def to_dict(self) -> dict:
        """What a calibration summary records: ``across_images``, ``within_images`` (4 significant
        digits) and ``constant_images``."""
        return {
            "across_images": float(f"{self.across:.4g}"),
            "within_images": float(f"{self.within:.4g}"),
            "constant_images": self.constant,
        }

    def refusal(self) -> str | None:
        """Why these images cannot calibrate anything, or None: every image is of one colour, so
        every statistic over their patches is singular (no patch differs from another but by the
        position embedding). Images for another purpose are never refused (:meth:`warnings`)."""
        if self.purpose == "calibration" and self.images and self.constant == self.images:
            return (
                f"{self._all()} of one colour (e.g. all black): no patch differs from another but by its "
                "position, so the statistics calibration gathers over them are singular; calibrate on photos "
                "like those the model will see"
            )
        return None

    def _all(self) -> str:
        return (
            f"the one {self.purpose} image is" if self.images == 1 else f"all {self.images} {self.purpose} images are"
        )

    def warnings(self) -> list[str]:
        """How little these images span, when it is little (:data:`LOW_SPAN`): images of one colour
        among them, images near-identical to each other, images with almost no detail."""
        found, n, purpose = [], self.images, self.purpose
        if 0 < self.constant < n and purpose == "calibration":
            found.append(
                f"{self.constant} of the {n} calibration images are of one colour (e.g. all black): they "
                "add nothing but the position embeddings to the statistics"
            )
        if 0 < self.constant and purpose != "calibration":
            found.append(
                f"{self._all() if self.constant == n else f'{self.constant} of the {n} {purpose} images are'} of "
                "one colour (e.g. all black): what is measured on them says little about the images the model "
                "will see"
            )
        if n > 1 and self.across < LOW_SPAN:
            found.append(
                f"the {n} {purpose} images are near-identical: they vary by {self.across:.2g} across images "
                "(per input value; the bundled photos: about 1), so they stand for one image, not the images "
                "the model will see; use varied photos"
            )
        if self.constant < n and self.within < LOW_SPAN:
            found.append(
                f"the {purpose} images have almost no detail: they vary by {self.within:.2g} within an image "
                "(the bundled photos: about 0.7); use photos like those the model will see"
            )
        return found


def warn_once(messages: list[str], said: set[str]) -> None:
    """``warnings.warn`` each of ``messages`` that is not in ``said`` yet, and add it there."""
    for message in messages:
        if message not in said:
            said.add(message)
            warnings.warn(message, stacklevel=2)


class CalibrationImages:
    """An iterable of preprocessed image batches ``(B, 3, H, W)`` float32.

    Two sources:
    - ``from_directory``: up to ``limit`` readable files, a seeded random choice when the
      directory holds more; unreadable files are skipped and counted. With ``crops``, a directory
      of fewer files than ``limit`` gives each file whole and then seeded random crops and flips of
      its files in turn (as the bundled photos are cropped) up to ``limit`` images.
    - ``from_builtin``: ``count`` seeded random crops (25-100 % of the area, aspect 3/4-4/3)
      and horizontal flips of a few bundled photos (by default the ten of
      ``CALIBRATION_PHOTOS``; ``HELD_OUT_PHOTOS`` are kept for evaluation).
    Each full iteration yields the same images in the same order. ``summary()``
    describes what the last iteration used (with how much the images span, :class:`ImageSpan`),
    ``image_sources`` the file each of its images came from (a bundled photo once per crop), in
    order, and ``source_digests`` the :func:`pixel_digest` of each of those files; for a directory,
    ``summary()`` holds the :func:`file_digest` (``image_digests``) and the :func:`pixel_digest`
    (``pixel_digests``) of each file used (sorted, each once). At the end of an iteration, images that
    span little, and files that are copies of others (identical pixels), are warned about
    (``warnings.warn``, each message once however often the images are read), and images that are
    all of one colour are refused (CorpError).
    """

    def __init__(
        self,
        sources: list,
        transform: Callable,
        batch_size: int,
        description: dict,
        limit: int,
        crop_seed: int | None = None,
        purpose: str = "calibration",
        fill: bool = False,
    ) -> None:
        if batch_size < 1:
            raise SettingError(f"{{setting}} must be >= 1, got {batch_size}", "batch_size")
        if limit < 1:
            raise SettingError(f"{{setting}} (the number of calibration images) must be >= 1, got {limit}", "limit")
        self._sources = sources
        self._transform = transform
        self._batch_size = batch_size
        self._limit = limit
        self._crop_seed = crop_seed
        self._fill = fill  # after the sources whole, crops of them up to the limit
        self._description = description
        self.used = 0
        self.skipped: list[str] = []
        self.image_sources: list[Path] = []
        self._digests: list[tuple[str, str]] = []  # (bytes, pixels) of each file read whole
        self._pixels: dict[Path, str] = {}
        self.span = ImageSpan(purpose)
        self._said: set[str] = set()  # the warnings given already

    @classmethod
    def from_directory(
        cls,
        directory: str | Path,
        transform: Callable,
        *,
        limit: int = DEFAULT_IMAGES,
        batch_size: int = DEFAULT_BATCH,
        seed: int = 0,
        purpose: str = "calibration",
        crops: bool = False,
    ) -> CalibrationImages:
        limit, batch_size, seed = _checked(transform, limit=limit, batch_size=batch_size, seed=seed)
        paths = find_images(directory)
        if not paths:
            raise CorpError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) found under {directory}")
        random.Random(seed).shuffle(paths)
        description = {"source": "directory", "path": str(Path(directory).resolve()), "files_found": len(paths)}
        if not crops or len(paths) >= limit:
            return cls(paths, transform, batch_size, description, limit, purpose=purpose)
        description["crops"] = f"each file whole, then {CROPS} of the readable files in turn up to the images asked for"
        return cls(paths, transform, batch_size, description, limit, crop_seed=seed, purpose=purpose, fill=True)

    @classmethod
    def from_builtin(
        cls,
        transform: Callable,
        *,
        count: int = DEFAULT_IMAGES,
        batch_size: int = DEFAULT_BATCH,
        seed: int = 0,
        photos: Sequence[str] = CALIBRATION_PHOTOS,
    ) -> CalibrationImages:
        count, batch_size, seed = _checked(transform, count=count, batch_size=batch_size, seed=seed)
        paths = builtin_photo_paths(photos)
        sources = [paths[i % len(paths)] for i in range(count)]
        return cls(
            sources,
            transform,
            batch_size,
            {
                "source": "builtin",
                "photos": list(photos),
                "augmentation": CROPS,
            },
            count,
            crop_seed=seed,
        )

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.used, self.skipped, self.image_sources, self.span = 0, [], [], ImageSpan(self.span.purpose)
        self._digests, self._pixels = [], {}
        rng = random.Random(self._crop_seed)
        batch: list[torch.Tensor] = []
        for path, cropped in self._planned():
            if self.used + len(batch) >= self._limit:
                break
            try:
                im = load_rgb(path)
                pixels = self._pixels.get(path) or pixel_digest(im)  # of the file, not of a crop
                whole = None if cropped else file_digest(path)  # a directory's file: for the overlap with other sets
                if cropped:
                    im = random_crop_flip(im, rng)
                batch.append(self._transform(im))
                self.image_sources.append(path)
                self._pixels[path] = pixels
                if whole is not None:
                    self._digests.append((whole, pixels))
            except UNREADABLE as exc:
                self.skipped.append(unreadable_reason(path, exc))
                continue
            if len(batch) == self._batch_size:
                yield from self._measured(torch.stack(batch))
                batch = []
        if batch:
            yield from self._measured(torch.stack(batch))
        if self.used == 0:
            raise CorpError(
                f"none of the {len(self.skipped)} image files could be read "
                f"(e.g. {self.skipped[0] if self.skipped else '-'})"
            )
        refusal = self.span.refusal()
        if refusal is not None:
            raise CorpError(refusal)
        warn_once(self.span.warnings() + self.copies_warnings(), self._said)

    def copies_warnings(self) -> list[str]:
        """What the last iteration says of the files (from a directory) that are copies of others
        (identical pixels, :func:`pixel_digest`): a message, or none. Crops of copies vary, so the
        span alone would not say it."""
        files = len(self._digests)
        copies = files - len(self.pixel_digests())
        if not copies:
            return []
        other_bytes = copies - (files - len(self.digests()))
        return [
            f"{copies} of the {files} {self.span.purpose} files {copies_named(copies, other_bytes, 'others')}: "
            "they add no image the others do not"
        ]

    def _planned(self) -> Iterator[tuple[Path, bool]]:
        """The files to read in order, each with whether a random crop of it is taken: every source
        cropped (the bundled photos), every one whole (a directory), or every one whole and then
        crops of those read so far in turn, without end (a directory filled with crops)."""
        cropped = self._crop_seed is not None and not self._fill
        yield from ((path, cropped) for path in self._sources)
        readable = list(dict.fromkeys(self.image_sources))
        while self._fill and readable:
            yield from ((path, True) for path in readable)

    @property
    def most(self) -> int:
        """The most images an iteration gives: the limit, or fewer when there are fewer sources
        and no crops fill them up (what memory and disk are checked for before they are read)."""
        return self._limit if self._fill else min(self._limit, len(self._sources))

    def _measured(self, batch: torch.Tensor) -> Iterator[torch.Tensor]:
        """``batch``, its span measured; counted as used once the consumer is done with it."""
        self.span.add(batch)
        yield batch
        self.used += len(batch)

    def summary(self) -> dict:
        """Where the images came from, how many were asked for and used, which files were
        skipped (``path: reason``, the first five), how much the images span
        (:meth:`ImageSpan.to_dict`; None before any image was read: the images are read lazily, as
        they are iterated) and, for a directory, the digests of the files used: of their bytes
        (``image_digests``, :func:`file_digest`) and of their pixels (``pixel_digests``, :func:`pixel_digest`)."""
        digests = (
            {"image_digests": self.digests(), "pixel_digests": self.pixel_digests()}
            if self._description["source"] == "directory"
            else {}
        )
        return {
            **self._description,
            "images_requested": self._limit,
            "images_used": self.used,
            "files_skipped": len(self.skipped),
            "skipped_examples": self.skipped[:5],
            "span": self.span.to_dict() if self.used else None,
            **digests,
        }

    def digests(self) -> list[str]:
        """The :func:`file_digest` of each file the last iteration used (from a directory), sorted, each once."""
        return sorted({whole for whole, _ in self._digests})

    def pixel_digests(self) -> list[str]:
        """The :func:`pixel_digest` of each file the last iteration used (from a directory), sorted, each once."""
        return sorted({pixels for _, pixels in self._digests})

    @property
    def source_digests(self) -> dict[Path, str]:
        """The :func:`pixel_digest` of each file in ``image_sources`` (of the file as decoded, not of a
        crop): what recovery tells its sources apart by, without decoding them again."""
        return dict(self._pixels)


def copies_named(copies: int, other_bytes: int, of: str) -> str:
    """How a message names ``copies`` images found to be copies ``of`` others (``others``,
    ``calibration images``) by their :func:`pixel_digest`, ``other_bytes`` of them not byte-identical
    (the same pixels saved in another format or encoding): ``is a byte-identical copy of others``,
    ``are byte-identical copies of others``, ``are pixel-identical copies of others (2 of them saved
    in another format or encoding)``."""
    if not other_bytes:
        return f"is a byte-identical copy of {of}" if copies == 1 else f"are byte-identical copies of {of}"
    saved = "saved in another format or encoding"
    if copies == 1:
        return f"is a pixel-identical copy of {of} ({saved})"
    return f"are pixel-identical copies of {of} ({other_bytes} of them {saved})"


def _checked(transform: object, **integers: object) -> tuple[int, ...]:
    """``integers`` (the counts and seed :class:`CalibrationImages` is made with) as Python ints, after
    BadUsage unless ``transform`` is callable and SettingError (naming it) for the first that is not an
    integer (a NumPy one is; a bool or a float such as 2.5 is not), as :class:`CalibrationSpec`
    checks its settings (:func:`~corp_deploy.errors.check_setting_types`)."""
    check_instance("transform", transform, Callable, "a callable (an image -> a tensor: model_transform(model)[0])")
    for name, value in integers.items():
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise SettingError(f"{{setting}} must be an integer, got {described(value)}", name)
    return tuple(int(value) for value in integers.values())


def summary_warnings(summary: dict) -> list[str]:
    """What the user should hear about a calibration read (:meth:`CalibrationImages.summary`, also
    an int8 export's record of its images): unreadable files skipped, fewer images used than asked for."""
    warnings = []
    if summary["files_skipped"]:
        reasons = "; ".join(summary["skipped_examples"][:3])
        warnings.append(f"skipped {summary['files_skipped']} unreadable calibration files ({reasons})")
    if summary["images_used"] < summary["images_requested"]:
        warnings.append(
            f"calibrated on {summary['images_used']} images, fewer than the {summary['images_requested']} "
            "asked for (--calib-samples): the directory has no more readable images"
        )
    return warnings


@dataclass(frozen=True)
class CalibrationSpec:
    """Which unlabelled images calibrate a compression, and how they are read.

    Attributes:
        source: a directory of images (searched recursively; a seeded random choice of
            ``samples`` when it holds more), or None for seeded crops of the bundled photos
            (:data:`CALIBRATION_PHOTOS`).
        samples: how many images.
        batch_size: how many images are preprocessed and run at once.
        seed: the seed of the choice of files and of the crops.
        crops: a directory of fewer files than ``samples`` is filled up to ``samples`` images with
            seeded random crops and flips of its files, each file whole first (measured on the
            photo set: 10 photos calibrate far better as 40 images than as 10; lab/RESULTS.md,
            "Calibration on the photo set"); False: the files alone.
    """

    source: Path | None = None
    samples: int = DEFAULT_IMAGES
    batch_size: int = DEFAULT_BATCH
    seed: int = 0
    crops: bool = True

    #: The settings of :meth:`settings` every artifact records (``calib_crops`` came later: an
    #: artifact without it was calibrated on its folder's files alone, :meth:`recorded`).
    ALWAYS_RECORDED: ClassVar[tuple[str, ...]] = ("calib_samples", "batch_size", "seed")

    def __post_init__(self) -> None:
        check_setting_types(self)
        for name in ("samples", "batch_size"):
            value = getattr(self, name)
            if value < 1:
                raise SettingError(f"{{setting}} must be an integer >= 1, got {value!r}", name)
        if self.samples > MAX_IMAGES:
            raise SettingError(f"{{setting}} must be at most {MAX_IMAGES:,}, got {self.samples!r}", "samples")
        if not 0 <= self.seed < 2**32:
            raise SettingError(f"{{setting}} must be an integer in [0, 2**32), got {self.seed!r}", "seed")
        if self.source is not None:
            object.__setattr__(self, "source", checked_path(self.source, "source"))

    @classmethod
    def recorded(
        cls,
        calibration: dict,
        settings: dict,
        *,
        source: Path | None = None,
        samples: int | None = None,
        batch_size: int | None = None,
    ) -> CalibrationSpec:
        """The calibration an artifact's ``config.json`` records (its ``calibration`` summary and its
        ``settings``: its directory, or the built-in photos; how many images, the batch size and the
        seed), with ``source``, ``samples`` or
        ``batch_size`` taking the place of the recorded value where given. CorpError when the
        recorded directory is not there any more, or a recorded setting is not valid."""
        if source is None and calibration.get("source") == "directory":
            source = Path(calibration["path"])
            if not source.is_dir():
                now = "not a folder any more" if source.exists() else "not there any more"
                raise CorpError(
                    f"the artifact was calibrated on {source}, which is {now}; "
                    "pass the calibration images with --calib DIR"
                )
        try:  # what the artifact records, checked apart from what is given: it is no usage of the caller's
            kept = cls(
                None,
                settings.get("calib_samples", DEFAULT_IMAGES),
                settings.get("batch_size", DEFAULT_BATCH),
                settings.get("seed", 0),
                settings.get("calib_crops", False),  # not recorded: calibrated on the folder's files alone
            )
        except SettingError as exc:
            raise CorpError(f"the artifact records calibration settings this corp-deploy cannot use: {exc}") from None
        return cls(source, samples or kept.samples, batch_size or kept.batch_size, kept.seed, kept.crops)

    def images(self, transform: Callable) -> CalibrationImages:
        """The images, preprocessed by ``transform`` (:func:`model_transform`)."""
        if self.source is None:
            return CalibrationImages.from_builtin(
                transform, count=self.samples, batch_size=self.batch_size, seed=self.seed
            )
        return CalibrationImages.from_directory(
            self.source, transform, limit=self.samples, batch_size=self.batch_size, seed=self.seed, crops=self.crops
        )

    def settings(self) -> dict:
        """The settings an artifact records beside the compression's (``calib_samples``,
        ``batch_size``, ``seed``, ``calib_crops``); where the images came from is in the calibration
        summary."""
        return {
            "calib_samples": self.samples,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "calib_crops": self.crops,
        }


def held_out_images(transform: Callable, count: int, batch_size: int = 32, seed: int = 0) -> CalibrationImages:
    """The held-out side of the bundled photos' split: ``count`` seeded crops and flips (seed
    ``seed + 1``) of the ``HELD_OUT_PHOTOS``, which built-in calibration never uses."""
    return CalibrationImages.from_builtin(
        transform, count=count, batch_size=batch_size, seed=seed + 1, photos=HELD_OUT_PHOTOS
    )


def split_builtin_images(
    transform: Callable, n_calib: int, n_held_out: int, batch_size: int = 32, seed: int = 0
) -> tuple[CalibrationImages, CalibrationImages]:
    """The bundled photos split into calibration images (``n_calib`` crops of the
    ``CALIBRATION_PHOTOS`` with ``seed``, what ``compress`` calibrates on by default) and
    :func:`held_out_images` (``n_held_out``, disjoint photos)."""
    calib = CalibrationImages.from_builtin(
        transform, count=n_calib, batch_size=batch_size, seed=seed, photos=CALIBRATION_PHOTOS
    )
    return calib, held_out_images(transform, n_held_out, batch_size, seed)


def random_crop_flip(im: Image.Image, rng: random.Random) -> Image.Image:
    """A random crop of 25-100 % of the area with aspect ratio in [3/4, 4/3], maybe mirrored."""
    width, height = im.size
    for _ in range(10):
        area = width * height * rng.uniform(0.25, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        if 0 < w <= width and 0 < h <= height:
            left, top = rng.randint(0, width - w), rng.randint(0, height - h)
            im = im.crop((left, top, left + w, top + h))
            break
    if rng.random() < 0.5:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return im


class SpooledBatches:
    """Image batches decoded once and kept on disk, read back one batch at a time.

    For work that passes over the same calibration images several times (int8 range collection
    and its checks): decoding happens once, and memory holds one batch however many images
    there are. ``folder`` must exist and outlive the object (a temporary directory)."""

    def __init__(self, batches: Iterable[torch.Tensor], folder: str | Path) -> None:
        self._files: list[Path] = []
        self.images = 0
        for i, batch in enumerate(batches):
            path = Path(folder) / f"batch-{i:05d}.npy"
            np.save(path, batch.numpy())
            self._files.append(path)
            self.images += len(batch)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for path in self._files:
            yield torch.from_numpy(np.load(path))
