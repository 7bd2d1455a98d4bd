"""The photo set (lab/photo_set.py): the shipped manifest's integrity and splits, the stamps'
compositing, the SHA-256 check, and a build end to end from scikit-image's bundled photos (no Debian
package is read)."""

import dataclasses
import random
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import skimage.data
from PIL import Image

from corp_deploy import CorpError
from corp_deploy.calibration import CALIBRATION_PHOTOS, HELD_OUT_PHOTOS
from corp_deploy.files import sha256_file
from lab import photo_set as ps

SHA256 = re.compile(r"[0-9a-f]{64}")
SKIMAGE_DATA = Path(skimage.data.__file__).parent


@pytest.fixture(scope="module")
def manifest() -> ps.Manifest:
    return ps.read_manifest()


def test_the_manifest_lists_each_source_once_by_a_well_formed_sha256(manifest):
    assert len({f.id for f in manifest.files}) == len(manifest.files)
    assert len({(f.package, f.path) for f in manifest.files}) == len(manifest.files)
    assert all(SHA256.fullmatch(f.sha256) for f in manifest.files)
    assert len({f.sha256 for f in manifest.files}) == len(manifest.files)  # a file is one source, in one split
    assert {f.kind for f in manifest.files} == set(ps.KINDS)
    assert ps.manifest_text(manifest) == ps.MANIFEST_PATH.read_text()  # written as the builder writes it


def test_every_package_of_the_files_is_listed_with_a_version_and_a_licence(manifest):
    packages = {p.name: p for p in manifest.packages}
    assert {f.package for f in manifest.files} == set(packages)
    assert all(p.version and p.licence for p in packages.values())
    debs = [p for p in packages.values() if p.name != ps.SCIKIT_IMAGE]
    assert all(p.deb.startswith(f"{p.name}_") and SHA256.fullmatch(p.deb_sha256) for p in debs)
    assert manifest.debian_release == "bookworm"


def test_the_splits_hold_opencv_doc_out_and_a_fifth_of_the_rest(manifest):
    splits = Counter(f.split for f in manifest.files)
    assert set(splits) == set(ps.SPLITS)  # none empty
    assert {f.package for f in manifest.files if f.split == "unlike"} == {ps.UNLIKE_PACKAGE}
    assert {f.split for f in manifest.files if f.package == ps.UNLIKE_PACKAGE} == {"unlike"}
    rest = [f for f in manifest.files if f.split != "unlike"]
    assert 0.15 <= sum(f.split == "held_out" for f in rest) / len(rest) <= 0.25
    for f in manifest.files:
        if f.package == ps.SCIKIT_IMAGE:  # the repository's own split of its bundled photos
            assert f.path in (HELD_OUT_PHOTOS if f.split == "held_out" else CALIBRATION_PHOTOS)
    assert {f.id: f.split for f in manifest.files} == ps.draw_splits(manifest.files, manifest.seed)


def test_the_draw_is_stratified_and_does_not_depend_on_the_order(manifest):
    shuffled = list(manifest.files)
    random.Random(0).shuffle(shuffled)
    assert ps.draw_splits(shuffled, manifest.seed) == ps.draw_splits(manifest.files, manifest.seed)
    strata = Counter((f.kind, f.category, f.split) for f in manifest.files if f.package != ps.SCIKIT_IMAGE)
    for (kind, category, split), count in strata.items():
        if split == "train" and count >= 4:  # a stratum of 5 sources or more has its fifth held out
            held = strata[(kind, category, "held_out")]
            assert held >= 1 and abs(held - 0.2 * (count + held)) < 1, (kind, category)


def stamp_file(folder: Path, alpha: int = 255, size=(80, 40)) -> Path:
    """A magenta 2:1 rectangle of ``alpha`` inside a transparent border, as a PNG."""
    image = Image.new("RGBA", (size[0] + 20, size[1] + 20), (0, 0, 0, 0))
    image.paste(Image.new("RGBA", size, (255, 0, 255, alpha)), (10, 10))
    path = folder / f"stamp_{alpha}.png"
    image.save(path)
    return path


def magenta_box(image: Image.Image) -> tuple[int, int, int, int] | None:
    """The bounding box of the (nearly) magenta pixels."""
    rgb = np.asarray(image, dtype=np.int32)
    near = np.abs(rgb - [255, 0, 255]).sum(axis=2) < 60
    return Image.fromarray((near * 255).astype(np.uint8)).getbbox()


def test_a_stamp_is_composited_inside_the_canvas_as_its_id_seeds_it(tmp_path):
    stamp = ps.load_stamp(stamp_file(tmp_path), "test/stamp")
    assert stamp.size == (80, 40)  # cropped to its object
    photos = [("p/green", Image.new("RGB", (300, 200), (0, 160, 0))), ("p/blue", Image.new("RGB", (200, 400), "blue"))]
    backgrounds = set()
    for i in range(20):
        image, background = ps.composite_stamp(stamp, f"tux/{i}", photos)
        again, same = ps.composite_stamp(stamp, f"tux/{i}", list(photos))
        assert image.tobytes() == again.tobytes() and background == same  # the id alone decides
        assert image.mode == "RGB" and image.size == (ps.CANVAS, ps.CANVAS)
        left, top, right, bottom = magenta_box(image)
        width, height = right - left, bottom - top
        assert ps.STAMP_SCALE[0] * ps.CANVAS - 2 <= width <= ps.STAMP_SCALE[1] * ps.CANVAS + 2
        assert abs(width / height - 2) < 0.1  # whole (not cut by an edge), its aspect kept
        backgrounds.add(background)
    assert backgrounds == {"plain", "p/green", "p/blue"}
    assert {ps.composite_stamp(stamp, "tux/0", [])[1]} == {"plain"}  # no photo of its split: a plain colour


def test_stamps_fully_opaque_or_fully_transparent(tmp_path):
    opaque = ps.load_stamp(stamp_file(tmp_path, alpha=255, size=(60, 60)), "test/opaque")
    image, _ = ps.composite_stamp(opaque, "tux/opaque", [])
    assert magenta_box(image) is not None
    full = Image.new("RGB", (30, 20), (255, 0, 255))  # no alpha at all: the whole image is the object
    full.save(tmp_path / "full.png")
    assert ps.load_stamp(tmp_path / "full.png", "test/full").size == (30, 20)
    with pytest.raises(CorpError, match="test/clear .* is fully transparent"):
        ps.load_stamp(stamp_file(tmp_path, alpha=0), "test/clear")


def test_a_file_whose_sha256_differs_is_refused_by_name(tmp_path):
    path = tmp_path / "photo.jpg"
    path.write_bytes(b"not the pinned bytes")
    ps.check_sha256(path, sha256_file(path), "mate/LadyBird")
    with pytest.raises(CorpError, match=r"mate/LadyBird \(.*photo.jpg\) has SHA-256 [0-9a-f]{64}, not the manifest's"):
        ps.check_sha256(path, "0" * 64, "mate/LadyBird")
    with pytest.raises(CorpError, match="mate/LadyBird is missing"):
        ps.check_sha256(tmp_path / "gone.jpg", "0" * 64, "mate/LadyBird")


def test_photo_sizes_are_only_ever_reduced():
    assert ps.photo_size(5120, 2880) == (569, 320)
    assert ps.photo_size(1000, 3000) == (213, 640)  # the longer side's limit binds
    assert ps.photo_size(300, 200) == (300, 200)  # never upscaled


def bundled_manifest(stamp_id: str = "skimage/logo") -> ps.Manifest:
    """A manifest of scikit-image's bundled files only: three photos and its logo (no transparency) as
    a held-out stamp."""
    rows = [
        ("skimage/astronaut", "astronaut.png", "photo", "people", "held_out"),
        ("skimage/chelsea", "chelsea.png", "photo", "animal", "train"),
        ("skimage/camera", "camera.png", "photo", "people", "held_out"),
        (stamp_id, "logo.png", "stamp", "object", "held_out"),
    ]
    return ps.Manifest(
        debian_release="bookworm",
        seed=1,
        packages=[ps.Package(name=ps.SCIKIT_IMAGE, version=skimage.__version__, licence="BSD-3-Clause")],
        files=[
            ps.Source(i, ps.SCIKIT_IMAGE, path, sha256_file(SKIMAGE_DATA / path), kind, category, split)
            for i, path, kind, category, split in rows
        ],
    )


def test_a_build_writes_every_file_checked_and_a_stamp_on_a_photo_of_its_split(tmp_path):
    # an id whose composite lies on a photo (the first draw of its generator is the plain colour's)
    stamp_id = next(
        f"skimage/logo{i}" for i in range(50) if ps.stamp_rng(f"skimage/logo{i}").random() >= ps.PLAIN_SHARE
    )
    manifest = bundled_manifest(stamp_id)
    index = ps.build(tmp_path / "set", tmp_path / "debs", manifest)
    photos = ps.PhotoSet(tmp_path / "set")
    assert [p.name for p in photos.paths("held_out")] == [
        "skimage__astronaut.jpg",
        "skimage__camera.jpg",
        stamp_id.replace("/", "__") + ".jpg",
    ]
    assert [e.id for e in photos.entries("train")] == ["skimage/chelsea"] and photos.paths("unlike") == []
    (stamp,) = [e for e in index.files if e.kind == "stamp"]
    assert stamp.background in ("skimage/astronaut", "skimage/camera")  # held out, as the stamp
    with Image.open(tmp_path / "set" / "train" / "skimage__chelsea.jpg") as chelsea:
        assert chelsea.mode == "RGB" and chelsea.size == (451, 300)  # smaller than the limits: kept
    assert index.counts["splits"]["held_out"] == {
        "total": 3,
        "kinds": {"photo": 2, "stamp": 1},
        "categories": {"object": 1, "people": 2},
    }
    assert ps.verify(tmp_path / "set", manifest).files == index.files
    assert ps.build(tmp_path / "again", tmp_path / "debs", manifest).files == index.files  # the same bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "set"]  # no staging folder left


def test_a_build_refuses_a_file_whose_sha256_differs_and_writes_nothing(tmp_path):
    manifest = bundled_manifest()
    changed = dataclasses.replace(manifest.files[1], sha256="0" * 64)
    manifest.files = [manifest.files[0], changed, *manifest.files[2:]]
    with pytest.raises(CorpError, match=r"skimage/chelsea \(scikit-image: chelsea.png\) .* has SHA-256"):
        ps.build(tmp_path / "set", tmp_path / "debs", manifest)
    assert list(tmp_path.iterdir()) == []


def test_a_set_not_built_or_a_foreign_folder_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(CorpError, match=f"no photo set at {tmp_path}.*python -m lab.photo_set build --out"):
        ps.PhotoSet(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CorpError, match="exists and is not a photo set"):
        ps.build(tmp_path, tmp_path / "debs", bundled_manifest())
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_build_deletes_only_its_own_folders(tmp_path):
    """Folders beside the output named as the builder once named its staging and old folders, and a
    folder with an ``index.json`` that is not a photo set's, are the user's: never removed."""
    manifest = bundled_manifest()
    for name in (".set.partial", ".set.old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_text("mine")
    ps.build(tmp_path / "set", tmp_path / "debs", manifest)
    index = ps.build(tmp_path / "set", tmp_path / "debs", manifest)  # replaces the set built before
    assert ps.verify(tmp_path / "set", manifest).files == index.files
    assert sorted(p.name for p in tmp_path.iterdir()) == [".set.old", ".set.partial", "set"]
    assert all((tmp_path / name / "mine.txt").read_text() == "mine" for name in (".set.old", ".set.partial"))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "index.json").write_text('{"format": "something-else"}')
    with pytest.raises(CorpError):
        ps.build(foreign, tmp_path / "debs", manifest)
    assert [p.name for p in foreign.iterdir()] == ["index.json"]
