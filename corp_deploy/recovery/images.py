"""What recovery trains and validates on: :class:`RecoveryImages` (the split of the calibration
images' sources, the held-out validation views) and :class:`TrainingViews` (the augmented training
views of every step, made in DataLoader worker processes: :func:`training_batches`)."""

from __future__ import annotations

import contextlib
import hashlib
import math
import signal
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2
from torchvision.transforms.v2.functional import pil_to_tensor

from ..calibration import check_batch, load_rgb, pixel_digest
from ..errors import CorpError
from ..interrupts import INTERRUPTS, signals_deferred
from .config import RecoveryConfig

#: The fewest validation views: each held-out source gives ``ceil(VALIDATION_VIEWS / sources)``
#: (a calibration set of a few photos cropped many times holds out one or two of them).
VALIDATION_VIEWS = 32
#: The most bytes of decoded training images (uint8) recovery keeps in memory, so that a step does
#: not decode its files again (decoding 16 photos took 0.25 s of the 0.35 s their views take on one
#: CPU core, and on a GPU a small model's step waits for them); images beyond it are decoded at each use.
DECODED_BYTES = 1 << 30
#: Training files are kept decoded at most this many times the model's input side on their shorter
#: side (larger photos are shrunk once, when decoded): the smallest crop (8 % of the area, 0.28 of
#: the side) of such an image still has more pixels than the view it is resized to.
DECODED_SIDE = 4


class RecoveryImages:
    """What recovery trains and validates on, made from the calibration images.

    The images' sources (the file each came from, when the batches say so with an
    ``image_sources`` list, as :class:`~corp_deploy.calibration.CalibrationImages` do; else each
    image is its own source) are told apart by content (:func:`source_keys`: files of identical
    pixels, byte-identical or saved in another format, or identical bare images, are one source,
    counted once, :attr:`duplicates` the copies found) and
    split, seeded: a ``validation`` share of the sources (rounded;
    at least one, at most half of them and 256) is held out. Its validation images are views of the
    held-out sources that training does not see (random resized crops, mirrored or not, seeded;
    ``ceil(VALIDATION_VIEWS / sources)`` of each), and the same views distorted once in colour
    and sharpness: a recovery must not buy fidelity on the one by losing it on the other.
    Compression must not see them either (it matches its own calibration images closely, so they
    would flatter it): made before compressing, :meth:`fit_batches` are the images it fits on
    (:attr:`batches`: all of them, as given). Training draws fresh augmented views of the other
    sources (:attr:`training`, a :class:`TrainingViews`): of the whole file each image came from (of
    the image itself for a bare tensor), its files decoded once here.

    Args:
        batches: preprocessed images ``(B, 3, H, W)``, floating-point and finite
            (:func:`~corp_deploy.calibration.check_batch`).
        data_config: the model's timm data config (``mean``, ``std``, ``input_size``).
    """

    def __init__(self, batches: Iterable[torch.Tensor], data_config: dict, config: RecoveryConfig) -> None:
        listed, images, keys, first, duplicates = _read(batches)
        shape = tuple(data_config["input_size"])
        if tuple(images.shape[1:]) != shape:  # a view would broadcast or resize it: compress refuses it
            raise CorpError(
                f"calibration batches must be images of the model's input shape {shape}; got {tuple(images.shape[1:])}"
            )
        distinct = list(first)
        held = _held_out(first, duplicates, config)
        order = torch.randperm(len(distinct), generator=torch.Generator().manual_seed(config.seed)).tolist()
        self.mean = torch.tensor(data_config["mean"]).view(3, 1, 1)
        self.std = torch.tensor(data_config["std"]).view(3, 1, 1)
        kept = [
            source if isinstance(source, Path) else (images[source] * self.std + self.mean).clamp(0, 1)
            for source in (first[distinct[i]] for i in order)
        ]
        self.batches = listed
        trained = {distinct[i] for i in order[held:]}
        self._images, self._batch = images, len(listed[0])
        self._fit = [i for i, key in enumerate(keys) if key in trained]
        self._held, self.duplicates = held, duplicates
        size = tuple(data_config["input_size"][1:])
        crop, distort = _augmentations(size, config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            each = math.ceil(VALIDATION_VIEWS / held)
            views = torch.stack([crop(_pixels(source)) for source in kept[:held] for _ in range(each)])
            self.validation = (views - self.mean) / self.std
            self.distorted = (torch.stack([distort(view) for view in views]) - self.mean) / self.std
        training = _decoded(kept[held:], DECODED_SIDE * max(size))
        self.training = TrainingViews(training, size, self.mean, self.std, config)

    def fit_batches(self) -> list[torch.Tensor]:
        """The calibration images of the training sources, in their order and batch size: what
        compression fits on so that the validation images are unseen by it too."""
        return [self._images[self._fit[i : i + self._batch]] for i in range(0, len(self._fit), self._batch)]

    @property
    def sources(self) -> tuple[int, int]:
        """``(training, validation)`` source counts."""
        return len(self.training.sources), self._held


def check_sources(batches: Iterable[torch.Tensor], config: RecoveryConfig) -> None:
    """CorpError, before any work, unless ``batches`` (as :class:`RecoveryImages` takes them) hold
    the distinct sources a recovery with ``config`` needs: one to validate on, one to train on."""
    _, _, _, first, duplicates = _read(batches)
    _held_out(first, duplicates, config)


def source_keys(images: torch.Tensor, sources: list[Path | int], known: dict[Path, str] | None = None) -> list[str]:
    """Each image's source as recovery's split tells them apart: the digest of its file's decoded
    pixels (:func:`~corp_deploy.calibration.pixel_digest`; taken from ``known`` where it holds the
    file, as :attr:`CalibrationImages.source_digests` does, else decoded here), or for a bare image
    (its index in ``images``, ``(N, 3, H, W)``) the digest of its own values: files of identical
    pixels (byte-identical, or the same pixels in another format) and identical images have one key."""
    digests = dict(known or {})
    keys = []
    for source in sources:
        if isinstance(source, Path):
            if source not in digests:
                digests[source] = pixel_digest(load_rgb(source))
            keys.append(digests[source])
        else:
            values = images[source].detach().cpu().contiguous().numpy().tobytes()
            keys.append(hashlib.blake2b(values, digest_size=8).hexdigest())
    return keys


def _read(batches: Iterable[torch.Tensor]) -> tuple[list, torch.Tensor, list[str], dict, int]:
    """``batches`` checked and listed, their images in one float32 tensor, each image's source key
    (:func:`source_keys`), the first source of each key (in the order first seen) and how many
    sources were copies of another."""
    listed = list(batches)
    if not listed:
        raise CorpError("the calibration set is empty")
    for batch in listed:
        check_batch(batch)
    images = torch.cat([batch.to(torch.float32) for batch in listed])
    sources = list(getattr(batches, "image_sources", None) or range(len(images)))  # known once read
    keys = source_keys(images, sources, getattr(batches, "source_digests", None))
    first: dict[str, Path | int] = {}
    for key, source in zip(keys, sources, strict=True):
        first.setdefault(key, source)
    return listed, images, keys, first, len(set(sources)) - len(first)


def _held_out(first: dict[str, Path | int], duplicates: int, config: RecoveryConfig) -> int:
    """How many of the distinct sources (``first``, as :func:`_read` gives them) validation holds out:
    a ``config.validation`` share (rounded; at least one, at most half and 256). CorpError when there
    are fewer than 2, naming the ``duplicates`` (copies of files: of identical pixels; of bare
    images: of identical values)."""
    sources = len(first)
    held = min(256, sources // 2, max(1, round(config.validation * sources)))
    if held < 1:
        kind = "pixel-identical" if any(isinstance(source, Path) for source in first.values()) else "byte-identical"
        copies = f" and {duplicates} {kind} cop{'y' if duplicates == 1 else 'ies'}" if duplicates else ""
        raise CorpError(
            f"recovery needs calibration images from at least 2 distinct sources (one to train on, one to "
            f"validate); got {sources}{copies}"
        )
    return held


class TrainingViews(Dataset):
    """The training views of recovery's steps: item ``step`` (from 1) is that step's batch of
    ``config.batch_size`` augmented views, preprocessed, ``(B, 3, H, W)``.

    The sources are visited in a seeded random order, epoch after epoch; each view is a random
    resized crop of its source, mirrored or not, a ``color`` share of them distorted (colour jitter,
    greyscale, blur, as self-supervised training augments: SimCLR, DINO), and a ``mix`` share mixed
    with the view before it in the batch (mixup with a uniform weight, as function-matching
    distillation does; teacher and student see the same mixture). Every draw is seeded by the seed,
    the step and the view's place in the batch alone, so a step's views are the same in every
    process, in whichever DataLoader worker makes them, and with none.

    Args:
        sources: the training sources: decoded files or images, ``(3, h, w)`` uint8 (or float in
            [0, 1] for an image given as a tensor), or files to decode at each use (a :class:`Path`,
            beyond :data:`DECODED_BYTES`).
    """

    def __init__(
        self,
        sources: list[torch.Tensor | Path],
        size: tuple[int, int],
        mean: torch.Tensor,
        std: torch.Tensor,
        config: RecoveryConfig,
    ) -> None:
        self.sources, self._size, self._mean, self._std = sources, size, mean, std
        self._batch, self._seed, self._color, self._mix = config.batch_size, config.seed, config.color, config.mix
        self._crop, self._distort = _augmentations(size, config)
        self._orders: dict[int, list[int]] = {}

    def __getitem__(self, step: int) -> torch.Tensor:
        with torch.random.fork_rng(devices=[]):
            views = torch.stack([self._view(step, place) for place in range(self._batch)])
            torch.manual_seed(_seed_of(self._seed, "mix", step))
            mixed = torch.rand(len(views)) < self._mix
            weight = torch.where(mixed, torch.rand(len(views)), 1.0).view(-1, 1, 1, 1)
            views = weight * views + (1 - weight) * views.roll(1, dims=0)
        return (views - self._mean) / self._std

    def _view(self, step: int, place: int) -> torch.Tensor:
        """View ``place`` of ``step``'s batch, in [0, 1] (the global RNG reseeded)."""
        torch.manual_seed(_seed_of(self._seed, "view", step, place))
        view = self._crop(_pixels(self.sources[self._source_at((step - 1) * self._batch + place)]))
        return self._distort(view) if torch.rand(1).item() < self._color else view

    def _source_at(self, position: int) -> int:
        """The source at ``position`` of the sequence of epochs (each a seeded permutation)."""
        epoch, index = divmod(position, len(self.sources))
        if epoch not in self._orders:
            self._orders = {epoch: torch.randperm(len(self.sources), generator=_generator(self._seed, epoch)).tolist()}
        return self._orders[epoch][index]


@contextlib.contextmanager
def training_batches(views: TrainingViews, steps: int, workers: int, pin_memory: bool) -> Iterator[Iterator]:
    """Steps 1 to ``steps`` of ``views``, made by ``workers`` DataLoader worker processes (0: in this
    process) ahead of their use, in pinned memory with ``pin_memory`` (for a copy to a GPU that does
    not wait); the workers are stopped when the ``with`` block ends, however it ends."""
    loader = DataLoader(
        views,
        batch_size=None,
        sampler=range(1, steps + 1),
        num_workers=workers,
        pin_memory=pin_memory,
        worker_init_fn=_ignore_interrupts if workers else None,
    )
    batches = None
    try:
        with signals_deferred():  # forked workers start with the interrupts held, until their init ignores them
            batches = iter(loader)
        yield batches
    finally:
        shutdown = getattr(batches, "_shutdown_workers", None)  # joins the workers (a private but long-lived API)
        if shutdown is not None:
            shutdown()


def _ignore_interrupts(worker: int) -> None:
    """In a worker: the interrupts are the main process's to handle (it stops the workers, and a
    worker whose parent is gone stops by itself); a worker would print a traceback for them."""
    for signum in INTERRUPTS:
        signal.signal(signum, signal.SIG_IGN)


def _seed_of(seed: int, *what) -> int:
    """A 63-bit seed for the draw ``what`` (a purpose and the step, ...) of recovery's ``seed``."""
    digest = hashlib.sha256(repr((seed, *what)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed(_seed_of(seed, "order", epoch))


def _decoded(sources: list[Path | torch.Tensor], side: int) -> list[Path | torch.Tensor]:
    """The training sources, files decoded once (``(3, h, w)`` uint8, shrunk so that the shorter side is
    at most ``side``) while they fit in :data:`DECODED_BYTES`; files beyond stay paths, decoded at each use."""
    decoded, total = [], 0
    for source in sources:
        if isinstance(source, Path) and total < DECODED_BYTES:
            image = _decode(source, side)
            if total + image.numel() <= DECODED_BYTES:
                source, total = image, total + image.numel()
        decoded.append(source)
    return decoded


def _decode(path: Path, side: int) -> torch.Tensor:
    """A file as ``(3, h, w)`` uint8, its shorter side shrunk to at most ``side``."""
    image = load_rgb(path)
    scale = side / min(image.size)
    if scale < 1:
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC)
    return pil_to_tensor(image)


def _pixels(source: Path | torch.Tensor) -> torch.Tensor:
    """A source as ``(3, h, w)`` floats in [0, 1]: an image given as a tensor as it is, a decoded
    file scaled from uint8, a file decoded now (as it is: a validation source, or beyond the bytes kept)."""
    if isinstance(source, Path):
        source = pil_to_tensor(load_rgb(source))
    return source.float() / 255 if source.dtype == torch.uint8 else source


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
