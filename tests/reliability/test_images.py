"""The images a command reads (calibration, recovery and evaluation folders): skipped, counted,
warned about or told apart as docs/reliability.md promises, never silently used as something else."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from corp_deploy.calibration import CalibrationImages, find_images, load_rgb
from corp_deploy.outputs import staged_output
from tests.reliability.common import BASE, BENCH, bomb, debris, image_folder, invoke, labelled_folder, plain, png


def test_evaluation_images_of_one_colour_are_warned_about_not_refused_as_calibration(work):
    """bench --data of black images: nothing is calibrated on them, so they are not refused for
    singular calibration statistics; the warning names them as evaluation images, on stderr and in
    the reports a CI job reads (JSON ``fidelity.data.warnings``, Markdown), labelled folder or not,
    each once (bench reads the images twice: for parity, then for fidelity)."""
    data = plain(work.parent / "black", ((0, 0, 0),) * 2)
    labelled = plain(work.parent / "labelled" / "a", ((0, 0, 0),) * 2).parent
    (labelled / "class_index.json").write_text('{"a": 0}')
    for folder in (data, labelled):
        reports = ["--json", work / "r.json", "--markdown", work / "r.md"]
        args = ["bench", work / "art", *BENCH, "--backends", "torch", "--data", folder, *reports]
        with pytest.warns(
            UserWarning, match=r"all 2 evaluation images are of one colour \(e\.g\. all black\): what"
        ) as given:
            code, text, exception = invoke(args, work.parent / "state")
        assert code == 0 and exception is None and "calibration images" not in text, text
        said = json.loads((work / "r.json").read_text())["fidelity"]["data"]["warnings"]
        assert sorted(str(w.message) for w in given if str(w.message) in said) == sorted(said)
        assert said[0].startswith("all 2 evaluation images are of one colour (e.g. all black): what is measured")
        assert said[1].startswith("the 2 evaluation images are near-identical: they vary by 0 across images")
        assert f"- warning: {said[0]}" in (work / "r.md").read_text()


def test_byte_identical_calibration_files_are_one_source_of_recovery_and_said(work):
    """A --calib folder holding each photo twice (under other names): recovery counts each once and
    keeps its copies on one side of the split (validation holds no copy of a training image), says
    how many copies it found on stderr and records it in the report's ``images``."""
    calib = image_folder(work.parent / "calib", 4)
    for i in range(4):
        shutil.copyfile(calib / f"{i}.png", calib / f"copy{i}.png")
    quick = ["--recover-steps", 1, "--recover-batch-size", 2, "--recover-eval-every", 1, "--calib-samples", 8]
    code, text, _ = invoke([*BASE[:-2], *quick, "--calib", calib, "-o", work / "o"], work.parent / "state")
    said = " ".join(text.split())
    copies = "recovery: 4 calibration sources were a copy of another (the same pixels): counted once"
    assert code == 0 and copies in said
    images = json.loads((work / "o" / "report.json").read_text())["recovery"]["images"]
    assert images["duplicate_sources"] == 4 and images["training_sources"] + images["validation_sources"] == 4, images


def test_a_decompression_bomb_and_unreadable_files_are_skipped_and_counted(work):
    """Also a dangling link and a FIFO named as images: counted, not left out unsaid (and the FIFO
    is never opened, which would wait forever)."""
    calib = image_folder(work / "calib", 3)
    bomb(calib / "big.png")
    (calib / "broken.jpg").write_bytes(b"no")
    (calib / "gone.jpg").symlink_to(work / "nowhere.jpg")
    os.mkfifo(calib / "pipe.png")
    (calib / "folder.jpg").mkdir()  # a folder is not an image file: not counted
    code, text, _ = invoke([*BASE, "--calib", calib, "-o", work / "o"], work.parent / "state")
    assert code == 0 and "Traceback" not in text, text
    assert "skipped 4 unreadable calibration files" in text
    assert "calibrated on 3 images, fewer than the 4 asked for" in text
    config = json.loads((work / "o" / "config.json").read_text())["calibration"]
    assert (config["images_used"], config["files_skipped"], config["images_requested"]) == (3, 4, 4)
    assert config["files_found"] == 7
    reasons = "\n".join(config["skipped_examples"])
    assert "decompression-bomb limit" in reasons and reasons.count("not a regular file") == 2, reasons
    assert not debris(work)


def test_a_decompression_bomb_in_bench_data_is_skipped_and_counted(work):
    data = image_folder(work / "val", 2)
    bomb(data / "big.png")
    code, text, _ = invoke(
        ["bench", work / "art", *BENCH, "--backends", "torch", "--data", data, "--json", work / "r.json"],
        work.parent / "state",
    )
    assert code == 0 and "skipped 1 unreadable evaluation files" in text, text
    report = json.loads((work / "r.json").read_text())
    assert report["fidelity"]["images"] == 2 and report["fidelity"]["data"]["files_skipped"] == 1


def test_16_bit_greyscale_is_scaled_not_whitened(tmp_path):
    levels = (np.arange(64 * 64).reshape(64, 64) * 16).astype(np.uint16)  # 0 .. 65520
    Image.fromarray(levels).save(tmp_path / "g16.png")
    rgb = np.asarray(load_rgb(tmp_path / "g16.png")).astype(np.float64)
    assert rgb.shape == (64, 64, 3) and (rgb[..., 0] == rgb[..., 2]).all()
    assert np.abs(rgb[..., 0] - levels / 256.0).max() <= 1.5  # the same grey levels on 8 bits (clipping: 255)


def test_an_exif_rotated_photo_is_loaded_upright(tmp_path):
    """A camera's portrait photo is stored sideways with an EXIF orientation tag: it is turned
    upright before use (calibration, evaluation and recovery images share the loader), as a viewer
    shows it. The photo: red above blue, stored turned a quarter to the left, tagged 6 (turn right)."""
    upright = Image.new("RGB", (20, 40), (0, 0, 255))
    upright.paste((255, 0, 0), (0, 0, 20, 20))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: the stored pixels must be turned 90 degrees clockwise
    upright.transpose(Image.Transpose.ROTATE_90).save(tmp_path / "portrait.jpg", exif=exif.tobytes(), quality=95)
    with Image.open(tmp_path / "portrait.jpg") as stored:
        assert stored.size == (40, 20)  # sideways as stored
    loaded = load_rgb(tmp_path / "portrait.jpg")
    assert loaded.size == (20, 40)
    rgb = np.asarray(loaded).astype(int)
    assert (np.abs(rgb[:16] - (255, 0, 0)).max(), np.abs(rgb[24:] - (0, 0, 255)).max()) < (40, 40)
    seen = CalibrationImages.from_directory(tmp_path, lambda image: torch.from_numpy(np.asarray(image).copy()))
    assert torch.equal(next(iter(seen))[0], torch.from_numpy(np.array(loaded)))


def test_calibration_images_that_span_little_are_warned_about_with_a_measure(work):
    """Near-identical images (one photo with a little noise) and images of one colour among photos:
    a warning each, with how little they span (the calibration summary records it too); the run
    completes. Images all of one colour are refused (``compress-calib-all-black``)."""
    photo = np.random.default_rng(0).integers(20, 235, (50, 40, 3))
    near = work / "near"
    near.mkdir()
    for i in range(4):
        noise = np.random.default_rng(i + 1).integers(-2, 3, photo.shape)
        Image.fromarray((photo + noise).astype(np.uint8)).save(near / f"{i}.png")
    with pytest.warns(UserWarning, match=r"the 4 calibration images are near-identical: they vary by 0\.0\d+ across"):
        code, text, _ = invoke([*BASE, "--calib", near, "-o", work / "o1"], work.parent / "state")
    assert code == 0, text
    span = json.loads((work / "o1" / "config.json").read_text())["calibration"]["span"]
    assert span["across_images"] < 0.1 < span["within_images"] and span["constant_images"] == 0
    mixed = plain(work / "mixed", [(0, 0, 0)] * 2)
    for i in (2, 3):
        png(mixed / f"{i}.png", seed=i)
    with pytest.warns(UserWarning, match="2 of the 4 calibration images are of one colour"):
        code, text, _ = invoke([*BASE, "--calib", mixed, "-o", work / "o2"], work.parent / "state")
    assert code == 0, text


def test_a_relative_calib_is_recorded_so_it_resolves_from_anywhere(work, monkeypatch):
    image_folder(work / "calib", 4)
    code, text, _ = invoke([*BASE, "--calib", "calib", "-o", "rel"], work.parent / "state")
    assert code == 0, text
    assert json.loads((work / "rel" / "config.json").read_text())["calibration"]["path"] == str(work / "calib")
    monkeypatch.chdir(work.parent)  # another directory: int8 export reads the recorded images
    code, text, _ = invoke(
        [
            "export",
            work / "rel",
            "--precision",
            "int8",
            "--int8-keep-float",
            0,
            "--min-cosine",
            0.5,
            "--min-top1",
            0,
            "--calib-samples",
            10,
        ],
        work.parent / "state",
    )  # (a random model on 4 random images: near-tied logits whose int8 top-1 depends on the CPU's
    # integer kernels; loose gates, as this is about paths)
    assert code == 0, text
    assert "fewer than" not in text  # the 4 files filled with crops, as the artifact was calibrated
    int8 = json.loads((work / "rel" / "export-int8" / "export.json").read_text())["models"]["model"]["int8"]
    assert int8["source"]["path"] == str(work / "calib") and int8["calibration_images"] == 10


def test_a_recovery_on_calibration_images_changed_since_compress_says_so(work):
    """recover compresses again on the recorded folder: other images there make another artifact."""
    state = work.parent / "state"
    image_folder(work.parent / "cal", 4)
    code, text, _ = invoke([*BASE, "--calib", work.parent / "cal", "-o", work / "c"], state)
    assert code == 0, text
    quick = ["--recover-steps", 1, "--recover-batch-size", 2, "--recover-eval-every", 1]
    code, text, _ = invoke(["recover", work / "c", *quick, "--calib-samples", 2, "-o", work / "fewer"], state)
    assert code == 0 and "holds other images" not in " ".join(text.split()), text  # fewer asked for: not a change
    for i in range(4):
        png(work.parent / "cal" / f"{i}.png", seed=10 + i)
    code, text, _ = invoke(["recover", work / "c", *quick, "-o", work / "r"], state)
    said = " ".join(text.split())
    assert code == 0 and "holds other images than when" in said and "(0 of the 4 it recorded are there)" in said, text


def test_the_files_of_an_output_inside_an_image_folder_are_not_images_of_it(work):
    """A bench report copied into the calibration folder: its plot is no photo (the folder holds a record)."""

    image_folder(work.parent / "cal", 3)
    with staged_output(work.parent / "cal" / "report", "bench") as folder:
        png(folder / "bench.png")
    assert [p.name for p in find_images(work.parent / "cal")] == ["0.png", "1.png", "2.png"]


def test_hidden_folders_that_the_class_index_does_not_name_are_not_classes(work):
    data = labelled_folder(work, {"cats": 1})
    image_folder(data / ".ipynb_checkpoints", 1)
    code, text, _ = invoke(
        ["bench", work / "art", *BENCH, "--backends", "torch", "--data", data, "--json", work / "r.json"],
        work.parent / "state",
    )
    assert code == 0, text
    assert json.loads((work / "r.json").read_text())["fidelity"]["data"]["classes"] == 1


def test_byte_identical_copies_of_calibration_images_are_not_held_out(tmp_path):
    """bench --data of a copy of the calibration folder elsewhere (new names too): the files' digests
    recorded in the artifact find the copies, so fidelity is reported as not held out, with a warning."""
    calib = image_folder(tmp_path / "calib", count=4)
    code, text, _ = invoke([*BASE, "--calib", calib, "-o", tmp_path / "art"], tmp_path / "state")
    assert code == 0, text
    copied, fresh = tmp_path / "elsewhere", tmp_path / "fresh"
    copied.mkdir()
    for i in range(2):  # other pixels (image_folder's would be the same files again)
        png(fresh / f"{i}.png", seed=10 + i)
    for i, path in enumerate(sorted(calib.iterdir())[:2]):
        shutil.copy(path, copied / f"renamed-{i}.png")
    for data, held_out in ((copied, False), (fresh, True)):
        out = tmp_path / f"{data.name}.json"
        code, text, _ = invoke(
            ["bench", tmp_path / "art", *BENCH, "--backends", "torch", "--data", data, "--json", out],
            tmp_path / "state",
        )
        assert code == 0, text
        assert json.loads(out.read_text())["fidelity"]["held_out"] is held_out
        assert ("byte-identical copies of calibration images" in " ".join(text.split())) is not held_out, text


def test_hidden_files_and_folders_in_calib_are_not_calibrated_on(tmp_path):
    """``.thumbnails/`` and ``._photo.png`` (what file browsers and macOS leave) are left out of the
    calibration images, as bench leaves hidden folders out of its classes."""
    calib = image_folder(tmp_path / "calib", count=2)
    png(calib / ".thumbnails" / "t.png", seed=7)
    png(calib / "._0.png", seed=8)
    code, text, _ = invoke([*BASE, "--calib", calib, "-o", tmp_path / "art"], tmp_path / "state")
    assert code == 0, text
    calibration = json.loads((tmp_path / "art" / "config.json").read_text())["calibration"]
    assert calibration["files_found"] == 2 and len(calibration["image_digests"]) == 2
    assert calibration["images_used"] == 4  # the 2 files, then crops of them (--calib-samples 4)


def test_calibration_follows_links_to_folders_once_and_says_nothing_before_it_reads(tmp_path):
    """A link to a folder inside ``--calib`` is followed (its images are calibration images), a link
    back up the tree is not walked twice; ``summary()`` before the images are read has no span."""
    calib = image_folder(tmp_path / "calib", count=1)
    image_folder(tmp_path / "more", count=3)
    (calib / "linked").symlink_to(tmp_path / "more")
    (calib / "loop").symlink_to(calib)
    found = CalibrationImages.from_directory(calib, lambda im: torch.zeros(3, 4, 4), limit=8)
    assert found.summary()["files_found"] == 4 and found.summary()["span"] is None
    code, text, _ = invoke([*BASE, "--calib", calib, "-o", tmp_path / "art"], tmp_path / "state")
    assert code == 0 and "fewer than" not in text, text
    assert json.loads((tmp_path / "art" / "config.json").read_text())["calibration"]["images_used"] == 4
