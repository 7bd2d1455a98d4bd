"""A folder of fewer images than asked for, filled with crops of its files (CalibrationSpec.crops)."""

import random
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from corp_deploy.calibration import (
    MAX_IMAGES,
    CalibrationImages,
    CalibrationSpec,
    file_digest,
    load_rgb,
    random_crop_flip,
    summary_warnings,
)
from corp_deploy.cli.options import IMAGE_COUNT
from corp_deploy.errors import CorpError, SettingError


def to_tensor(image: Image.Image) -> torch.Tensor:
    """A fixed-size tensor of the image's pixels: a crop resized back, so crops and files compare."""
    return torch.from_numpy(np.asarray(image.resize((16, 12)), dtype=np.float32).copy()).permute(2, 0, 1)


@pytest.fixture
def folder(tmp_path):
    """Three distinct 40x30 photos-like images (seeded noise)."""
    rng = np.random.default_rng(0)
    for name in ("a.png", "b.png", "c.png"):
        Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(tmp_path / name)
    return tmp_path


def read(images: CalibrationImages) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # filled up: no "fewer than asked" warning is due
        return torch.cat(list(images))


def test_a_small_folder_is_filled_with_crops_of_its_files_each_whole_first(folder):
    images = CalibrationImages.from_directory(folder, to_tensor, limit=8, batch_size=3, seed=5, crops=True)
    got = read(images)
    sources = images.image_sources
    assert got.shape == (8, 3, 12, 16) and images.used == 8
    assert sorted(sources[:3]) == sorted(folder.glob("*.png")) and sources[3:] == sources[:3] + sources[:2]
    rng = random.Random(5)  # the crops, made independently: each file in turn, one seeded generator
    expected = [to_tensor(load_rgb(path)) for path in sources[:3]]
    expected += [to_tensor(random_crop_flip(load_rgb(path), rng)) for path in sources[3:]]
    assert torch.equal(got, torch.stack(expected))
    assert not any(torch.equal(got[i], got[i + 3]) for i in range(3))  # a crop is not the file again
    assert torch.equal(read(images), got)  # every iteration the same
    summary = images.summary()
    assert (summary["images_used"], summary["images_requested"], summary["files_found"]) == (8, 8, 3)
    assert "crops" in summary and summary["image_digests"] == sorted(file_digest(p) for p in sources[:3])


def test_without_crops_or_with_enough_files_the_folder_gives_its_files_alone(folder):
    alone = CalibrationImages.from_directory(folder, to_tensor, limit=8, seed=5)
    got = read(alone)
    assert got.shape[0] == 3 and "crops" not in alone.summary()
    assert "calibrated on 3 images, fewer than the 8 asked for" in " ".join(summary_warnings(alone.summary()))
    enough = CalibrationImages.from_directory(folder, to_tensor, limit=3, seed=5, crops=True)
    assert torch.equal(read(enough), got) and "crops" not in enough.summary()


def test_unreadable_files_are_counted_once_and_never_cropped(folder):
    (folder / "broken.jpg").write_bytes(b"not an image")
    images = CalibrationImages.from_directory(folder, to_tensor, limit=9, seed=1, crops=True)
    got = read(images)
    summary = images.summary()
    assert got.shape[0] == 9 and summary["files_skipped"] == 1 and summary["files_found"] == 4
    assert all(path.name != "broken.jpg" for path in images.image_sources)


def test_the_spec_takes_no_more_images_than_the_command_line_does():
    """An artifact's recorded ``calib_samples`` above the range ``--calib-samples`` takes is refused as
    a recorded setting, before any image is read (10**12 grew memory until the process was killed)."""
    assert IMAGE_COUNT.max == MAX_IMAGES
    CalibrationSpec(None, MAX_IMAGES)
    with pytest.raises(SettingError, match="samples must be at most 10,000,000, got 10000001"):
        CalibrationSpec(None, MAX_IMAGES + 1)
    with pytest.raises(CorpError, match="the artifact records calibration settings this corp-deploy cannot use"):
        CalibrationSpec.recorded({"source": "builtin"}, {"calib_samples": 10**12})


def test_the_spec_records_crops_and_reads_an_older_artifact_as_files_alone(folder):
    spec = CalibrationSpec(folder, 8)
    assert spec.crops and spec.settings()["calib_crops"] is True
    assert spec.images(to_tensor).most == 8
    older = {"calibration": {"source": "directory", "path": str(folder)}, "settings": {"calib_samples": 8}}
    assert CalibrationSpec.recorded(older["calibration"], older["settings"]).crops is False
    assert CalibrationSpec.recorded(older["calibration"], {"calib_samples": 8, "calib_crops": True}).crops
    assert CalibrationSpec(folder, 8, crops=False).images(to_tensor).most == 3


def test_byte_identical_copies_are_warned_about_also_when_crops_fill_the_folder(folder):
    """Crops of copies of one photo vary, so the span does not call them near-identical: the
    copies are counted from the files' digests instead."""
    for name in ("d.png", "e.png"):
        (folder / name).write_bytes((folder / "a.png").read_bytes())
    images = CalibrationImages.from_directory(folder, to_tensor, limit=12, seed=0, crops=True)
    with pytest.warns(UserWarning, match="2 of the 5 calibration files are byte-identical copies of others"):
        assert torch.cat(list(images)).shape[0] == 12
