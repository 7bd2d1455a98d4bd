"""How calibration, recovery and bench tell image sources apart (by their decoded pixels), the
arguments ``CalibrationImages`` is made with, and links in a calibration folder (issue 68)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from benchmarks.data import eval_images
from benchmarks.targets import copied_calibration_images
from corp_deploy import CorpError
from corp_deploy.calibration import (
    CalibrationImages,
    CalibrationSpec,
    _up_the_tree,
    copies_named,
    file_digest,
    find_images,
    load_rgb,
    pixel_digest,
)
from corp_deploy.errors import BadUsage, SettingError
from corp_deploy.recovery import RecoveryConfig, RecoveryImages
from corp_deploy.recovery import images as recovery_images
from tests.helpers import SMALL_VIT_CLI_ARGS

#: The recovery tests' data config: images of 3 x 8 x 8.
DATA_CONFIG = {"mean": (0.5, 0.4, 0.3), "std": (0.2, 0.25, 0.3), "input_size": (3, 8, 8)}


def pixels(seed: int, size=(30, 40)) -> Image.Image:
    """A photo-like RGB image of seeded noise."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def to_tensor(image: Image.Image) -> torch.Tensor:
    """A 3 x 8 x 8 float tensor of the image (what a model's transform gives, small)."""
    return torch.from_numpy(np.asarray(image.resize((8, 8)), dtype=np.float32).copy()).permute(2, 0, 1) / 255


def save_as(image: Image.Image, path: Path) -> Path:
    """``image`` saved losslessly in the format its suffix names (a PNG at the highest compression
    level when the name ends in ``-9.png``): other bytes, the same pixels."""
    path.parent.mkdir(parents=True, exist_ok=True)
    options = {".webp": {"lossless": True}, ".png": {"compress_level": 9 if path.stem.endswith("-9") else 6}}
    image.save(path, **options.get(path.suffix, {}))
    return path


def read_all(images: CalibrationImages) -> list[str]:
    """Iterate ``images`` once; the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(images)
    return [str(w.message) for w in caught]


# ------------------------------------------------ 1. sources told apart by their pixels


def test_the_same_pixels_in_other_formats_have_one_pixel_digest_and_lossy_ones_do_not(tmp_path):
    image = pixels(0)
    same = [save_as(image, tmp_path / name) for name in ("a.png", "a-9.png", "a.webp", "a.bmp", "a.tiff")]
    image.save(tmp_path / "a.jpg", quality=90)
    assert len({file_digest(path) for path in same}) == len(same)  # other bytes each
    assert {pixel_digest(load_rgb(path)) for path in same} == {pixel_digest(image)}
    assert pixel_digest(load_rgb(tmp_path / "a.jpg")) != pixel_digest(image)  # lossy: other pixels
    flat = Image.fromarray(np.zeros((4, 6, 3), np.uint8))  # the same bytes in another shape differ
    assert pixel_digest(flat) != pixel_digest(Image.fromarray(np.zeros((6, 4, 3), np.uint8)))


def test_calibration_warns_about_copies_of_a_file_in_other_formats_and_records_pixel_digests(tmp_path):
    a, b = pixels(1), pixels(2)
    files = [save_as(a, tmp_path / n) for n in ("a.png", "a-9.png", "a.webp", "a.bmp")] + [
        save_as(b, tmp_path / "b.png")
    ]
    images = CalibrationImages.from_directory(tmp_path, to_tensor, limit=8)
    said = read_all(images)
    assert (
        "3 of the 5 calibration files are pixel-identical copies of others (3 of them saved in another format or "
        "encoding): they add no image the others do not"
    ) in said, said
    summary = images.summary()
    assert summary["image_digests"] == sorted(file_digest(path) for path in files)  # bytes, as before
    assert summary["pixel_digests"] == sorted({pixel_digest(a), pixel_digest(b)})
    assert images.source_digests == {path: pixel_digest(load_rgb(path)) for path in files}


def test_copies_are_named_byte_identical_only_when_they_are():
    assert copies_named(1, 0, "others") == "is a byte-identical copy of others"
    assert copies_named(2, 0, "others") == "are byte-identical copies of others"
    assert copies_named(1, 1, "x") == "is a pixel-identical copy of x (saved in another format or encoding)"
    assert copies_named(3, 2, "x") == "are pixel-identical copies of x (2 of them saved in another format or encoding)"


class Sourced(list):
    """Batches that name the file each image came from, as CalibrationImages do."""

    def __init__(self, batches, sources):
        super().__init__(batches)
        self.image_sources = sources


def test_a_copy_in_another_format_is_one_source_of_recovery_on_one_side_of_the_split(tmp_path):
    """4 photos, each as PNG, lossless WebP and BMP: 4 sources, each held out or trained on whole,
    so validation never holds a copy of a training image (by bytes they were 12 sources)."""
    paths = [save_as(pixels(i % 4), tmp_path / f"{i}{('.png', '.webp', '.bmp')[i // 4]}") for i in range(12)]
    x = torch.stack([to_tensor(load_rgb(path)) for path in paths])
    for seed in range(5):
        images = RecoveryImages(
            Sourced([x[:6], x[6:]], paths), DATA_CONFIG, RecoveryConfig(validation=0.5, seed=seed, batch_size=4)
        )
        assert images.duplicates == 8 and images.sources == (2, 2)
        fit = torch.cat(images.fit_batches())
        assert len(fit) == 6  # the 3 copies of each training photo
        held = [image for image in x if not any(torch.equal(image, seen) for seen in fit)]
        assert len(held) == 6  # every copy of the 2 held-out photos, none beside a copy in training
    with pytest.raises(CorpError, match=r"at least 2 distinct sources .*; got 1 and 2 pixel-identical copies"):
        RecoveryImages(Sourced([x[[0, 4, 8]]], [paths[0], paths[4], paths[8]]), DATA_CONFIG, RecoveryConfig())


def test_recovery_splits_distinct_files_as_it_did_by_their_bytes(tmp_path, monkeypatch):
    """A set without such copies: the same split (fit images, validation views, training sources)
    as when sources were keyed by the files' bytes, so the weights stay bit-identical."""
    paths = [save_as(pixels(10 + i), tmp_path / f"{i}.png") for i in range(10)]
    x = torch.stack([to_tensor(load_rgb(path)) for path in paths])
    config = RecoveryConfig(validation=0.3, seed=3, batch_size=4)
    now = RecoveryImages(Sourced([x[:4], x[4:]], paths), DATA_CONFIG, config)

    def by_bytes(images, sources, known=None):  # the keys before: the digest of each file's bytes
        return [file_digest(source) for source in sources]

    monkeypatch.setattr(recovery_images, "source_keys", by_bytes)
    before = RecoveryImages(Sourced([x[:4], x[4:]], paths), DATA_CONFIG, config)
    assert now.sources == before.sources == (7, 3) and now.duplicates == before.duplicates == 0
    assert all(torch.equal(a, b) for a, b in zip(now.fit_batches(), before.fit_batches(), strict=True))
    assert torch.equal(now.validation, before.validation) and torch.equal(now.distorted, before.distorted)
    assert all(torch.equal(a, b) for a, b in zip(now.training.sources, before.training.sources, strict=True))


def test_recovery_takes_the_pixel_digests_calibration_decoded_and_decodes_only_the_others(tmp_path, monkeypatch):
    paths = [save_as(pixels(20 + i), tmp_path / f"{i}.png") for i in range(3)]
    calibration = CalibrationImages.from_directory(tmp_path, to_tensor, limit=3, batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny noise images: near-identical once resized to 8 x 8
        batch = torch.cat(list(calibration))
    assert sorted(calibration.image_sources) == paths
    decoded = []
    monkeypatch.setattr(recovery_images, "load_rgb", lambda path: decoded.append(path) or load_rgb(path))
    keys = recovery_images.source_keys(batch, calibration.image_sources, calibration.source_digests)
    assert keys == [pixel_digest(load_rgb(path)) for path in calibration.image_sources] and not decoded
    known = {calibration.image_sources[0]: "given"}
    keys = recovery_images.source_keys(batch, calibration.image_sources, known)
    assert keys[0] == "given" and sorted(decoded) == sorted(calibration.image_sources[1:])


def test_bench_finds_copies_in_other_formats_for_new_artifacts_and_byte_copies_for_old_ones(tmp_path):
    """An artifact records ``pixel_digests`` beside ``image_digests`` (the files' bytes); one made before
    records only the latter, and is still compared by bytes: byte-identical copies found, others not."""
    calib = [save_as(pixels(30 + i), tmp_path / "calib" / f"{i}.png") for i in range(3)]
    images = CalibrationImages.from_directory(tmp_path / "calib", to_tensor, limit=3)
    read_all(images)
    new = SimpleNamespace(config=SimpleNamespace(calibration=images.summary()))
    old_summary = {k: v for k, v in images.summary().items() if k != "pixel_digests"}
    old = SimpleNamespace(config=SimpleNamespace(calibration=old_summary))
    data = tmp_path / "data"
    save_as(load_rgb(calib[0]), data / "renamed.webp")  # another format
    (data / "copy.png").write_bytes(calib[1].read_bytes())  # byte-identical
    save_as(pixels(99), data / "fresh.png")
    evaluation = eval_images(data, to_tensor, limit=3)
    read_all(evaluation)
    assert copied_calibration_images(new, evaluation.digests, evaluation.pixel_digests) == (2, 1)
    assert copied_calibration_images(old, evaluation.digests, evaluation.pixel_digests) == (1, 0)
    no_digests = SimpleNamespace(config=SimpleNamespace(calibration={}))
    assert copied_calibration_images(no_digests, evaluation.digests, evaluation.pixel_digests) == (0, 0)


def test_a_labelled_evaluation_folder_gives_the_pixel_digests_of_its_files(tmp_path):
    data = tmp_path / "val"
    files = [save_as(pixels(40 + i), data / name / f"{i}.bmp") for i, name in enumerate(("cat", "dog"))]
    (data / "class_index.json").write_text(json.dumps({"cat": 0, "dog": 1}))
    evaluation = eval_images(data, to_tensor, limit=4)
    read_all(evaluation)
    assert evaluation.labelled and evaluation.pixel_digests == {pixel_digest(load_rgb(path)) for path in files}
    assert evaluation.digests == {file_digest(path) for path in files}


def test_bench_of_calibration_images_saved_in_another_format_is_not_held_out(tmp_path, run_cli):
    """End to end: compress records the pixel digests; bench --data of the same photos as lossless WebP
    reports fidelity not held out, with a warning naming them as pixel-identical copies."""
    calib = tmp_path / "calib"
    for i in range(4):
        save_as(pixels(50 + i, (50, 40)), calib / f"{i}.png")
    state = tmp_path / "state"
    args = ["compress", "deit_tiny", "--no-pretrained", *SMALL_VIT_CLI_ARGS, "--calib-samples", 4]
    result, text = run_cli([*args, "--calib", calib, "-o", tmp_path / "art"], state)
    assert result.exit_code == 0, text
    recorded = json.loads((tmp_path / "art" / "config.json").read_text())["calibration"]
    assert len(recorded["pixel_digests"]) == 4 and len(recorded["image_digests"]) == 4
    for i in range(2):
        save_as(load_rgb(calib / f"{i}.png"), tmp_path / "webp" / f"other-{i}.webp")
    bench = ["--batch", 1, "--min-time", 0.01, "--warmup", 0, "--data-samples", 2, "--backends", "torch"]
    out = tmp_path / "r.json"
    result, text = run_cli(["bench", tmp_path / "art", *bench, "--data", tmp_path / "webp", "--json", out], state)
    assert result.exit_code == 0, text
    assert json.loads(out.read_text())["fidelity"]["held_out"] is False
    said = " ".join(text.split())
    assert "2 of the evaluation images are pixel-identical copies of calibration images (2 of them saved" in said, said
    twice = tmp_path / "twice"  # copies among the evaluation images: said in the report too, for CI to read
    for name in ("same.png", "same.bmp", "other.png"):
        save_as(pixels(90 if name.startswith("same") else 91, (50, 40)), twice / name)
    bench = [*bench[:-4], "--data-samples", 3, "--backends", "torch"]
    result, text = run_cli(["bench", tmp_path / "art", *bench, "--data", twice, "--json", out], state)
    assert result.exit_code == 0, text
    recorded = json.loads(out.read_text())["fidelity"]["data"]["warnings"]
    copies = "1 of the 3 evaluation files is a pixel-identical copy of others (saved in another format or encoding)"
    assert any(message.startswith(copies) for message in recorded), recorded


# ------------------------------------------------ 2. and 3. the arguments CalibrationImages is made with


@pytest.fixture
def folder(tmp_path):
    for i in range(2):
        save_as(pixels(60 + i), tmp_path / f"{i}.png")
    return tmp_path


@pytest.mark.parametrize("transform", [None, "resize", 3])
def test_a_transform_that_is_not_callable_is_refused_up_front(folder, transform):
    message = rf"transform must be a callable \(an image -> a tensor: .*\), not {type(transform).__name__}$"
    with pytest.raises(BadUsage, match=message):
        CalibrationImages.from_directory(folder, transform)
    with pytest.raises(BadUsage, match=message):
        CalibrationImages.from_builtin(transform, count=2)
    with pytest.raises(BadUsage, match=message):
        CalibrationSpec(folder, 2).images(transform)


@pytest.mark.parametrize(
    "name, value",
    [("limit", 2.5), ("limit", True), ("limit", "2"), ("batch_size", 2.0), ("batch_size", False), ("seed", 1.5)],
)
def test_integer_arguments_must_be_integers_as_the_spec_checks_its_samples(folder, name, value):
    with pytest.raises(SettingError, match=r"samples must be an integer, got 4\.0"):
        CalibrationSpec(samples=4.0)
    shown = f"str {value!r}" if isinstance(value, str) else repr(value)
    with pytest.raises(SettingError, match=rf"^{name} must be an integer, got {shown}$") as refused:
        CalibrationImages.from_directory(folder, to_tensor, **{name: value})
    assert refused.value.settings == (name,)
    built = {"count" if name == "limit" else name: value}
    with pytest.raises(SettingError, match=rf"must be an integer, got {shown}$"):
        CalibrationImages.from_builtin(to_tensor, **built)


def test_numpy_integers_are_integers(folder):
    images = CalibrationImages.from_directory(folder, to_tensor, limit=np.int64(2), batch_size=np.int32(1))
    read_all(images)
    assert images.used == 2 and images.summary()["images_requested"] == 2
    assert type(images.summary()["images_requested"]) is int  # serialises to JSON


# ------------------------------------------------ 4. links that lead out of the calibration folder


def test_a_link_up_the_tree_is_refused_naming_it(tmp_path):
    """A link to ``..`` would make every image beside the folder (here ``outside.png``) a calibration
    image, one to ``/`` the whole file system (only its rule is tried here: never walked by a test).
    Refused, naming the link."""
    calib = tmp_path / "calib"
    save_as(pixels(70), calib / "a.png")
    save_as(pixels(71), tmp_path / "outside.png")
    for name, target in (("up", ".."), ("sub/deep/home", "../../..")):
        link = calib / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target)
        with pytest.raises(CorpError, match=rf"^{link} is a link to {tmp_path}, a folder that holds the folder"):
            CalibrationImages.from_directory(calib, to_tensor)
        link.unlink()
    assert find_images(calib) == [calib / "a.png"]
    assert _up_the_tree(Path("/"), calib, calib) and _up_the_tree(tmp_path, calib / "sub", calib)
    assert not _up_the_tree(calib, calib / "sub", calib) and not _up_the_tree(tmp_path / "other", calib, calib)


def test_a_link_up_the_tree_from_a_linked_folder_is_refused(tmp_path):
    calib, more = tmp_path / "calib", tmp_path / "shared" / "more"
    save_as(pixels(72), calib / "a.png")
    save_as(pixels(73), more / "b.png")
    (calib / "more").symlink_to(more)
    assert find_images(calib) == [calib / "a.png", calib / "more" / "b.png"]  # a link elsewhere: followed
    (more / "up").symlink_to(tmp_path / "shared")
    with pytest.raises(
        CorpError, match=r"more/up is a link to .*shared, a folder that holds the folder the link is in"
    ):
        find_images(calib)


def test_links_inside_the_folder_and_to_images_are_followed(tmp_path):
    calib = tmp_path / "calib"
    save_as(pixels(74), calib / "sub" / "a.png")
    save_as(pixels(75), tmp_path / "elsewhere.png")
    (calib / "a-again.png").symlink_to(calib / "sub" / "a.png")  # a file inside
    (calib / "sub-again").symlink_to(calib / "sub")  # a folder inside: walked once
    (calib / "sub" / "back").symlink_to(calib)  # back to the folder itself: walked once
    (calib / "linked.png").symlink_to(tmp_path / "elsewhere.png")  # an image elsewhere
    found = find_images(calib)  # sub/ and sub-again/ are one folder, walked once by whichever name comes first
    assert found[:2] == [calib / "a-again.png", calib / "linked.png"] and len(found) == 3
    assert found[2] in (calib / "sub" / "a.png", calib / "sub-again" / "a.png")
    assert [path.resolve() for path in found] == [
        (calib / "sub" / "a.png"),
        tmp_path / "elsewhere.png",
        found[0].resolve(),
    ]


def test_compress_refuses_a_calibration_folder_with_a_link_to_its_parent(tmp_path, run_cli):
    calib = tmp_path / "calib"
    for i in range(2):
        save_as(pixels(80 + i), calib / f"{i}.png")
    (calib / "parent").symlink_to("..")
    args = ["compress", "deit_tiny", "--no-pretrained", *SMALL_VIT_CLI_ARGS, "--calib-samples", 2]
    result, text = run_cli([*args, "--calib", calib, "-o", tmp_path / "art"], tmp_path / "state")
    assert result.exit_code == 1 and "Traceback" not in text, text
    assert result.output.count("Error:") == 1 and f"{calib / 'parent'} is a link to {tmp_path}, a folder" in text, text
    assert not (tmp_path / "art").exists()
    assert os.readlink(calib / "parent") == ".."
