"""A reproducible offline photo set for calibration and recovery studies, built from pinned Debian
packages and scikit-image's bundled photos (docs/photo_set.md).

``lab/photo_set_manifest.json`` lists every source file: its package (a Debian package of one
release, pinned by version and the .deb's SHA-256, or ``scikit-image``), its path there, its SHA-256,
its kind (``photo``: a photograph; ``stamp``: a photographed object on a transparent background), a
category word and its split: ``unlike`` (all of ``opencv-doc``: another photographer and subject mix),
``held_out`` (a seeded draw of about a fifth of the other sources, stratified by kind and category:
:func:`draw_splits`) or ``train``.

``python -m lab.photo_set build --out DIR`` writes each photo upright, in RGB, downscaled, and
each stamp composited onto a background of its own split (a plain colour or a blurred photo), as
JPEG, under ``DIR/<split>/``, with ``DIR/index.json``; :class:`PhotoSet` reads a built set.
"""

from __future__ import annotations

import colorsys
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import click
from PIL import ExifTags, Image, ImageFilter, ImageOps

from corp_deploy.bundled_photos import HELD_OUT_PHOTOS
from corp_deploy.documents import Document, DocumentFormat, Record, optional_entry
from corp_deploy.errors import CorpError
from corp_deploy.files import sha256_file, write_json

#: The manifest beside this module (the lab, in a checkout).
MANIFEST_PATH = Path(__file__).with_name("photo_set_manifest.json")
MANIFEST_FORMAT = DocumentFormat(
    "corp-deploy-photo-set-manifest", 1, "photo-set manifest", "use the corp-deploy that wrote it"
)
INDEX_FORMAT = DocumentFormat(
    "corp-deploy-photo-set", 1, "photo-set index", "build the photo set again", file="index.json"
)
INDEX_FILE = "index.json"

SPLITS = ("train", "held_out", "unlike")
KINDS = ("photo", "stamp")
#: The package held out whole, as the ``unlike`` split.
UNLIKE_PACKAGE = "opencv-doc"
#: The one source that is not a Debian package: the photos bundled in the installed scikit-image.
SCIKIT_IMAGE = "scikit-image"
#: The share of the other sources drawn into ``held_out`` (scikit-image's own split aside).
HELD_OUT_SHARE = 0.2

#: Photos are downscaled (never upscaled) until the shorter side is at most the first and the
#: longer at most the second.
PHOTO_SIDES = (320, 640)
#: Stamps are composited onto a square canvas of this side, the object's longer side a seeded
#: share of it within ``STAMP_SCALE``.
CANVAS = 320
STAMP_SCALE = (0.4, 0.85)
#: The share of stamps on a plain colour; the others lie on a blurred crop of a photo.
PLAIN_SHARE = 0.35
BLUR_RADIUS = 8
#: Alpha above this counts as part of a stamp's object (its bounding box).
VISIBLE_ALPHA = 16
JPEG_QUALITY = 90

#: Where ``build`` looks for (and downloads) the .deb files unless ``--debs`` says otherwise.
DEFAULT_DEBS = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "corp-deploy" / "debs"

_SHA256 = re.compile(r"[0-9a-f]{64}")
#: EXIF orientations that turn the image a quarter (its width and height swap).
_QUARTER_TURNS = (5, 6, 7, 8)


@dataclass(frozen=True)
class Package(Record):
    """A package the sources come from: a Debian package (``deb``: its file name as ``apt-get download``
    writes it, and that file's SHA-256) or ``scikit-image`` (no .deb: its installed data folder)."""

    name: str
    version: str
    licence: str
    deb: str | None = optional_entry()
    deb_sha256: str | None = optional_entry()


@dataclass(frozen=True)
class Source(Record):
    """One selected file of a package: ``path`` inside it (inside scikit-image's data folder for
    scikit-image), the file's ``sha256``; ``licence`` where it differs from the package's."""

    id: str
    package: str
    path: str
    sha256: str
    kind: str
    category: str
    split: str
    licence: str | None = optional_entry()

    @property
    def file_name(self) -> str:
        """Its output's name inside its split's folder."""
        return self.id.replace("/", "__") + ".jpg"


@dataclass(kw_only=True)
class Manifest(Document):
    """The photo set's sources: the Debian release, the split draw's seed, the packages, the files."""

    FORMAT = MANIFEST_FORMAT

    debian_release: str
    seed: int
    packages: list[Package]
    files: list[Source]

    def __post_init__(self) -> None:
        problem = next(manifest_problems(self), None)
        if problem is not None:
            raise CorpError(problem)

    def files_of(self, package: str) -> list[Source]:
        """The files of ``package``, in the manifest's order."""
        return [f for f in self.files if f.package == package]


def manifest_problems(manifest: Manifest) -> Iterator[str]:
    """What is wrong with ``manifest``'s entries, one sentence each (nothing when it is sound)."""
    names = [p.name for p in manifest.packages]
    yield from (f"package {n} is listed twice" for n, c in Counter(names).items() if c > 1)
    for p in manifest.packages:
        if (p.deb is None) != (p.deb_sha256 is None) or (p.deb is None and p.name != SCIKIT_IMAGE):
            yield f"package {p.name} needs its .deb file name and its SHA-256"
        if p.deb_sha256 is not None and not _SHA256.fullmatch(p.deb_sha256):
            yield f"package {p.name}'s deb_sha256 is not a SHA-256 (64 lower-case hex digits)"
    for key in ("id", "sha256", "file_name"):
        counts = Counter(getattr(f, key) for f in manifest.files)
        yield from (f"{key} {value} is listed twice" for value, c in counts.items() if c > 1)
    for f in manifest.files:
        if not _SHA256.fullmatch(f.sha256):
            yield f"{f.id}: sha256 is not a SHA-256 (64 lower-case hex digits)"
        if f.package not in names:
            yield f"{f.id}: package {f.package} is not listed"
        if f.kind not in KINDS or f.split not in SPLITS:
            yield f"{f.id}: kind must be one of {KINDS} and split one of {SPLITS}"
    used = {f.package for f in manifest.files}
    yield from (f"package {n} has no files" for n in names if n not in used)


def read_manifest(path: str | Path = MANIFEST_PATH) -> Manifest:
    """The manifest at ``path`` (the shipped one by default), checked; CorpError naming it otherwise."""
    return Manifest.read(path)


def draw_splits(files: Sequence[Source], seed: int, share: float = HELD_OUT_SHARE) -> dict[str, str]:
    """Each file's split by its id: ``unlike`` for :data:`UNLIKE_PACKAGE`; for scikit-image, the
    bundled split (``held_out`` for :data:`~corp_deploy.bundled_photos.HELD_OUT_PHOTOS`, ``train``
    otherwise); the rest drawn, ``round(share * n)`` of them ``held_out``, stratified by (kind,
    category): each stratum gets its share (largest remainders round it) drawn by a generator
    seeded from ``seed`` and the stratum, so that a file's split depends only on its stratum."""
    splits = {}
    strata = defaultdict(list)
    for f in files:
        if f.package == UNLIKE_PACKAGE:
            splits[f.id] = "unlike"
        elif f.package == SCIKIT_IMAGE:
            splits[f.id] = "held_out" if Path(f.path).name in HELD_OUT_PHOTOS else "train"
        else:
            strata[(f.kind, f.category)].append(f.id)
    drawn = sum(len(ids) for ids in strata.values())
    quotas = _largest_remainders({key: share * len(ids) for key, ids in strata.items()}, round(share * drawn))
    for (kind, category), ids in sorted(strata.items()):
        rng = random.Random(f"{seed}/{kind}/{category}")
        chosen = set(rng.sample(sorted(ids), quotas[(kind, category)]))
        splits.update((i, "held_out" if i in chosen else "train") for i in ids)
    return splits


def _largest_remainders(shares: dict, total: int) -> dict:
    """Whole numbers near ``shares`` (by key) summing to ``total``: each share rounded down, then one
    more for the largest fractions (ties by key)."""
    quotas = {key: math.floor(s) for key, s in shares.items()}
    by_fraction = sorted(shares, key=lambda key: (quotas[key] - shares[key], key))
    for key in by_fraction[: total - sum(quotas.values())]:
        quotas[key] += 1
    return quotas


def check_sha256(path: Path, expected: str, what: str) -> None:
    """CorpError naming ``what`` (the file as the manifest knows it) and ``path`` when the file's
    SHA-256 is not ``expected``."""
    if not path.is_file():
        raise CorpError(f"{what} is missing: there is no file {path}; nothing was written")
    found = sha256_file(path)
    if found != expected:
        raise CorpError(
            f"{what} ({path}) has SHA-256 {found}, not the manifest's {expected}: it is not the pinned "
            f"file (another version, or damaged); nothing was written"
        )


# Images -------------------------------------------------------------------------------------------


def photo_size(width: int, height: int) -> tuple[int, int]:
    """The size a photo of ``width`` x ``height`` is written at: scaled down (never up), its aspect
    kept, until its shorter side is at most ``PHOTO_SIDES[0]`` and its longer at most ``PHOTO_SIDES[1]``."""
    scale = min(1.0, PHOTO_SIDES[0] / min(width, height), PHOTO_SIDES[1] / max(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


def load_photo(path: Path) -> Image.Image:
    """The photo at ``path`` upright (by its EXIF orientation), in RGB (transparency over white),
    downscaled to :func:`photo_size` with LANCZOS."""
    with Image.open(path) as image:
        turned = image.getexif().get(ExifTags.Base.Orientation, 1) in _QUARTER_TURNS
        stored = photo_size(*image.size)
        image.draft("RGB", stored)  # JPEG: decode at the smallest scale that still covers the size
        rgb = _opaque(ImageOps.exif_transpose(image))
    size = stored[::-1] if turned else stored
    return rgb if rgb.size == size else rgb.resize(size, Image.Resampling.LANCZOS)


def _opaque(image: Image.Image) -> Image.Image:
    """``image`` in RGB, any transparency composited over white."""
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def load_stamp(path: Path, what: str) -> Image.Image:
    """The stamp at ``path`` as RGBA, cropped to its object (alpha above :data:`VISIBLE_ALPHA`; a
    stamp without transparency is its whole image); CorpError naming ``what`` when nothing of it is
    visible."""
    with Image.open(path) as image:
        rgba = image.convert("RGBA")
    box = rgba.getchannel("A").point(lambda a: 255 if a > VISIBLE_ALPHA else 0).getbbox()
    if box is None:
        raise CorpError(f"stamp {what} ({path}) is fully transparent: there is no object to composite")
    return rgba.crop(box)


def stamp_rng(stamp_id: str) -> random.Random:
    """The generator of a stamp's composite, seeded by the SHA-256 of its id (so that it does not
    depend on the order or number of the other stamps)."""
    return random.Random(int.from_bytes(hashlib.sha256(stamp_id.encode()).digest()[:8], "big"))


def plain_background(rng: random.Random) -> Image.Image:
    """A canvas of one colour: a grey, or a muted colour (low saturation, middle brightness)."""
    if rng.random() < 0.5:
        level = rng.randint(70, 200)
        colour = (level, level, level)
    else:
        red, green, blue = colorsys.hsv_to_rgb(rng.random(), rng.uniform(0.15, 0.45), rng.uniform(0.35, 0.85))
        colour = (round(red * 255), round(green * 255), round(blue * 255))
    return Image.new("RGB", (CANVAS, CANVAS), colour)


def blurred_background(rng: random.Random, photo: Image.Image) -> Image.Image:
    """A square crop of ``photo`` (half its shorter side or more, at a seeded place), resized to the
    canvas and blurred (Gaussian, radius :data:`BLUR_RADIUS`)."""
    width, height = photo.size
    side = max(1, round(min(width, height) * rng.uniform(0.5, 1.0)))
    left, top = rng.randint(0, width - side), rng.randint(0, height - side)
    crop = photo.crop((left, top, left + side, top + side)).resize((CANVAS, CANVAS), Image.Resampling.BICUBIC)
    return crop.filter(ImageFilter.GaussianBlur(BLUR_RADIUS))


def composite_stamp(
    stamp: Image.Image, stamp_id: str, photos: Sequence[tuple[str, Image.Image]]
) -> tuple[Image.Image, str]:
    """``stamp`` (RGBA, cropped to its object) on a ``CANVAS`` x ``CANVAS`` RGB background, and what
    the background is (``plain`` or the photo's id). All choices come from :func:`stamp_rng`: a plain
    colour (:data:`PLAIN_SHARE` of stamps, or all when ``photos`` is empty) or a blurred crop of one of
    ``photos`` (``(id, image)``, photos of the stamp's split only); the object's longer side a share
    of the canvas within :data:`STAMP_SCALE` (aspect kept); its place, fully inside the canvas."""
    rng = stamp_rng(stamp_id)
    if rng.random() < PLAIN_SHARE or not photos:
        canvas, background = plain_background(rng), "plain"
    else:
        background, photo = photos[rng.randrange(len(photos))]
        canvas = blurred_background(rng, photo)
    scale = rng.uniform(*STAMP_SCALE) * CANVAS / max(stamp.size)
    size = (max(1, round(stamp.width * scale)), max(1, round(stamp.height * scale)))
    item = stamp.resize(size, Image.Resampling.LANCZOS)
    place = (rng.randint(0, CANVAS - size[0]), rng.randint(0, CANVAS - size[1]))
    canvas.paste(item, place, item)
    return canvas, background


def save_jpeg(image: Image.Image, path: Path) -> None:
    """Write ``image`` as a JPEG of quality :data:`JPEG_QUALITY` (no metadata)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, "JPEG", quality=JPEG_QUALITY)


# Packages -----------------------------------------------------------------------------------------


def deb_file(package: Package, debs: Path, release: str) -> Path:
    """``package``'s .deb in ``debs``, downloaded there (:func:`download_deb`) when it is missing, its
    SHA-256 checked against the manifest's."""
    path = debs / package.deb
    if not path.is_file():
        download_deb(package, debs, release)
    check_sha256(path, package.deb_sha256, f"the .deb of {package.name} {package.version}")
    return path


def download_deb(package: Package, debs: Path, release: str) -> None:
    """Run ``apt-get download NAME=VERSION`` in ``debs``; CorpError saying what to do when it fails."""
    spec = f"{package.name}={package.version}"
    debs.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["apt-get", "download", spec], cwd=debs, capture_output=True, text=True)
    except FileNotFoundError:
        raise CorpError(
            f"{package.deb} is not in {debs}, and apt-get, to download it, is not installed here: put the "
            f"file there (or name its folder with --debs)"
        ) from None
    if done.returncode != 0 or not (debs / package.deb).is_file():
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise CorpError(
            f"apt-get download {spec} failed ({why}): run `apt-get update` first, with Debian {release} "
            f"in apt's sources, or put {package.deb} in {debs}"
        )


@contextlib.contextmanager
def extracted(deb: Path) -> Iterator[Path]:
    """The files of ``deb``, extracted with ``dpkg-deb -x`` into a temporary folder that is removed
    afterwards."""
    with tempfile.TemporaryDirectory(prefix="corp-deploy-deb-") as folder:
        try:
            done = subprocess.run(["dpkg-deb", "-x", str(deb), folder], capture_output=True, text=True)
        except FileNotFoundError:
            raise CorpError("dpkg-deb, to unpack the .deb files, is not installed here (Debian's dpkg)") from None
        if done.returncode != 0:
            raise CorpError(f"dpkg-deb -x {deb} failed: {done.stderr.strip() or done.returncode}")
        yield Path(folder)


@contextlib.contextmanager
def package_root(package: Package, debs: Path, release: str) -> Iterator[Path]:
    """The folder the package's ``path`` entries are relative to: its extracted .deb, or the
    installed scikit-image's data folder."""
    if package.deb is None:
        import skimage.data

        yield Path(skimage.data.__file__).parent
    else:
        with extracted(deb_file(package, debs, release)) as root:
            yield root


# The built set ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputFile(Record):
    """One image of a built set: ``file`` relative to the set's folder, its source's manifest entry
    (id, split, kind, category, SHA-256), its own SHA-256 and, for a stamp, its ``background``
    (``plain`` or the photo's id)."""

    file: str
    id: str
    split: str
    kind: str
    category: str
    source_sha256: str
    sha256: str
    background: str | None = optional_entry()


@dataclass(kw_only=True)
class PhotoSetIndex(Document):
    """A built set's ``index.json``: the manifest it was built from (SHA-256), the Pillow that encoded
    it (JPEG bytes may differ across versions), every file and the counts (:func:`count_files`)."""

    FORMAT = INDEX_FORMAT

    manifest_sha256: str
    pillow: str
    files: list[OutputFile]
    counts: dict


def count_files(files: Sequence[OutputFile]) -> dict:
    """How many files in all, per kind, per category, and per split (each again per kind and category)."""

    def tally(rows: Sequence[OutputFile]) -> dict:
        return {
            "total": len(rows),
            "kinds": dict(sorted(Counter(f.kind for f in rows).items())),
            "categories": dict(sorted(Counter(f.category for f in rows).items())),
        }

    return {**tally(files), "splits": {s: tally([f for f in files if f.split == s]) for s in SPLITS}}


class BuildProgress:
    """What :func:`build` tells as it goes (this base tells nothing)."""

    def stage(self, title: str, count: int) -> None:
        """A stage begins: ``count`` files of ``title`` (a package, or the stamps' compositing)."""

    def advance(self) -> None:
        """One file more is written."""


def build(
    out: str | Path,
    debs: str | Path = DEFAULT_DEBS,
    manifest: Manifest | None = None,
    progress: BuildProgress | None = None,
) -> PhotoSetIndex:
    """Build the photo set of ``manifest`` (the shipped one by default) into ``out``: staged in a folder
    beside it and renamed into place at the end, replacing a set built before (nothing half-written;
    a folder that holds anything else is refused). ``debs`` holds the .deb files (missing ones are
    downloaded there)."""
    out = Path(out).absolute()
    check_replaceable(out)
    manifest = manifest or read_manifest()
    progress = progress or BuildProgress()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))  # this run's own
    try:
        files = write_files(manifest, staging, Path(debs), progress)
        index = PhotoSetIndex(
            manifest_sha256=hashlib.sha256(manifest_text(manifest).encode()).hexdigest(),
            pillow=Image.__version__,
            files=files,
            counts=count_files(files),
        )
        write_json(staging / INDEX_FILE, index.to_dict())
        put_in_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return index


def write_files(manifest: Manifest, folder: Path, debs: Path, progress: BuildProgress) -> list[OutputFile]:
    """Write every file of ``manifest`` into ``folder`` (``<split>/<id>.jpg``), each source's SHA-256
    checked first: the photos package by package, then the stamps, each on a background drawn among
    the photos of its split. The written files, sorted."""
    photos = defaultdict(list)  # split -> [(id, image)]
    stamps = []
    written = []
    for package in manifest.packages:
        sources = manifest.files_of(package.name)
        progress.stage(f"{package.name} {package.version}", len(sources))
        with package_root(package, debs, manifest.debian_release) as root:
            for source in sources:
                path = root / source.path
                check_sha256(path, source.sha256, f"{source.id} ({package.name}: {source.path})")
                if source.kind == "stamp":
                    stamps.append((source, load_stamp(path, source.id)))
                    continue
                image = load_photo(path)
                photos[source.split].append((source.id, image))
                written.append(write_file(folder, source, image))
                progress.advance()
    progress.stage("stamps on backgrounds", len(stamps))
    for source, stamp in stamps:
        image, background = composite_stamp(stamp, source.id, sorted(photos[source.split]))
        written.append(write_file(folder, source, image, background))
        progress.advance()
    return sorted(written, key=lambda f: f.file)


def write_file(folder: Path, source: Source, image: Image.Image, background: str | None = None) -> OutputFile:
    """Write ``image``, made from ``source``, as ``<split>/<file_name>`` under ``folder``; its index entry."""
    relative = f"{source.split}/{source.file_name}"
    save_jpeg(image, folder / relative)
    return OutputFile(
        file=relative,
        id=source.id,
        split=source.split,
        kind=source.kind,
        category=source.category,
        source_sha256=source.sha256,
        sha256=sha256_file(folder / relative),
        background=background,
    )


def check_replaceable(out: Path) -> None:
    """CorpError unless ``out`` is missing, an empty folder or a photo set (its ``index.json`` one this
    builder writes: read and checked, so that no other folder is replaced)."""
    if out.exists() and not (out.is_dir() and ((out / INDEX_FILE).is_file() or not any(out.iterdir()))):
        raise CorpError(f"{out} exists and is not a photo set (no {INDEX_FILE}): give another --out, or remove it")
    if (out / INDEX_FILE).is_file():
        read_index(out)  # CorpError when it is not a photo set's index


def put_in_place(staging: Path, out: Path) -> None:
    """Rename the finished ``staging`` folder to ``out``, the set there before (checked by
    :func:`check_replaceable`) moved into a fresh folder of this run's and removed with it."""
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    if out.exists():
        out.rename(old / out.name)
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def manifest_text(manifest: Manifest) -> str:
    """The manifest file's text: indented JSON, each file's entry on one line."""
    data = manifest.to_dict()
    rows = ",\n".join("    " + json.dumps(f) for f in data.pop("files"))
    head = json.dumps(data, indent=2).removesuffix("\n}")
    return f'{head},\n  "files": [\n{rows}\n  ]\n}}\n'


def read_index(root: Path) -> PhotoSetIndex:
    """The ``index.json`` of the set at ``root``; CorpError with the build command when there is none."""
    path = Path(root) / INDEX_FILE
    if not path.is_file():
        raise CorpError(
            f"no photo set at {root} (no {INDEX_FILE}): build it with "
            f"`python -m lab.photo_set build --out {root}` (docs/photo_set.md)"
        )
    return PhotoSetIndex.read(path)


def verify(root: str | Path, manifest: Manifest | None = None) -> PhotoSetIndex:
    """The index of the set at ``root`` once every file is checked: built from ``manifest`` (the
    shipped one by default), each listed file present with its SHA-256, no other file; CorpError
    naming the first problems otherwise."""
    root = Path(root)
    index = read_index(root)
    manifest = manifest or read_manifest()
    problems = []
    if index.manifest_sha256 != hashlib.sha256(manifest_text(manifest).encode()).hexdigest():
        problems.append("it was built from another manifest: build it again")
    listed = {f.file for f in index.files}
    present = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != INDEX_FILE}
    problems += [f"{name} is missing" for name in sorted(listed - present)]
    problems += [f"{name} is not in {INDEX_FILE}" for name in sorted(present - listed)]
    problems += [
        f"{f.file} has changed since it was built"
        for f in index.files
        if f.file in present and sha256_file(root / f.file) != f.sha256
    ]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CorpError(f"the photo set at {root} does not verify: {'; '.join(problems[:5])}{more}")
    return index


class PhotoSet:
    """A built photo set, for studies: its images by split, and what each is.

    >>> photos = PhotoSet("/data/photo-set")          # doctest: +SKIP
    >>> calibration = photos.paths("train")            # doctest: +SKIP
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()
        self.index = read_index(self.root)

    def entries(self, split: str | None = None) -> list[OutputFile]:
        """The files of ``split`` (all when None), sorted by file: each with its id, kind, category."""
        if split is not None and split not in SPLITS:
            raise CorpError(f"the photo set's splits are {', '.join(SPLITS)}; got {split!r}")
        return [f for f in self.index.files if split is None or f.split == split]

    def paths(self, split: str | None = None) -> list[Path]:
        """The image paths of ``split`` (all when None), sorted."""
        return [self.root / f.file for f in self.entries(split)]


# Command line -------------------------------------------------------------------------------------


@click.group()
def cli() -> None:
    """The photo set (docs/photo_set.md): build it from the pinned packages, verify a built one, or draw
    the manifest's splits again."""


@cli.command("build")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The folder to build the set in.")
@click.option(
    "--debs",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_DEBS,
    show_default=True,
    help="The folder of the .deb files; missing ones are downloaded there with apt-get.",
)
def build_command(out: Path, debs: Path) -> None:
    """Build the photo set into OUT, then print its counts."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    manifest = read_manifest()
    console = Console()
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as bar:
        index = _failing_as_message(build, out, debs, manifest, _RichProgress(bar, len(manifest.files)))
    console.print(counts_table(index.counts))
    console.print(f"{index.counts['total']} images in {out.absolute()}")


@cli.command("verify")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The folder of the built set.")
def verify_command(out: Path) -> None:
    """Check the set in OUT against its index and the manifest."""
    index = _failing_as_message(verify, out)
    click.echo(f"{out}: {index.counts['total']} images verified (manifest, SHA-256 of each file, no other file)")


@cli.command("resplit")
def resplit_command() -> None:
    """Draw the manifest's splits again (after its files changed) and write them into it."""
    manifest = read_manifest()
    splits = draw_splits(manifest.files, manifest.seed)
    manifest.files = [dataclasses.replace(f, split=splits[f.id]) for f in manifest.files]
    MANIFEST_PATH.write_text(manifest_text(manifest))
    click.echo(f"{MANIFEST_PATH}: {dict(Counter(splits.values()))}")


class _RichProgress(BuildProgress):
    """A bar over all files, and a line per stage."""

    def __init__(self, bar, total: int) -> None:
        self.bar = bar
        self.task = bar.add_task("", total=total)

    def stage(self, title: str, count: int) -> None:
        self.bar.console.print(f"{title}: {count} files")
        self.bar.update(self.task, description=title)

    def advance(self) -> None:
        self.bar.advance(self.task)


def counts_table(counts: dict):
    """The counts of :func:`count_files` as a rich table: a row per kind and per category, a column per split."""
    from rich.table import Table

    table = Table()
    for column in ("", *SPLITS, "all"):
        table.add_column(column, overflow="fold")
    for group in ("kinds", "categories"):
        for name in sorted(counts[group]):
            row = [counts["splits"][s][group].get(name, 0) for s in SPLITS]
            table.add_row(name, *map(str, row), str(counts[group][name]))
        table.add_section()
    table.add_row("total", *(str(counts["splits"][s]["total"]) for s in SPLITS), str(counts["total"]))
    return table


def _failing_as_message(function, *args):
    """``function(*args)``, a CorpError shown as its message (exit status 1), not a traceback."""
    try:
        return function(*args)
    except CorpError as exc:
        raise click.ClickException(str(exc)) from None


if __name__ == "__main__":
    cli()
