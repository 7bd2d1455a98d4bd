"""Reliability: adversarial inputs and faults over compress, export, bench and sweep.

Every case asserts the exit status, exactly one message and no traceback, that nothing the user
had was changed (every file under the case's folder is compared byte for byte before and after),
and that nothing was left behind: no staging or old-output folders beside an output, no files in
the temporary directory. docs/reliability.md lists every case; a test keeps the two in step.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import multiprocessing
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import click
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from corp_deploy import CorpError, load_compressed
from corp_deploy.artifact import recorded_checksums
from corp_deploy.calibration import CalibrationImages, load_rgb
from corp_deploy.cli import cli
from corp_deploy.files import write_json
from corp_deploy.outputs import RECORD_FILE, staged_output, verify_files, write_record
from exporters import tensorrt as trt_backend
from tests.helpers import AS_A_FOREGROUND_JOB, build_small_vit
from tests.helpers import SMALL_VIT_CLI_ARGS as TINY

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "reliability.md"
BASE = ["compress", "deit_tiny", "--no-pretrained", *TINY, "--calib-samples", "4"]
BENCH = ["--batch", "1", "--min-time", "0.01", "--warmup", "0", "--data-samples", "2"]


# ---------------------------------------------------------------- helpers


def invoke(args, state: Path):
    """``corp-deploy ARGS`` in-process: (exit status, everything it printed, the exception if any)."""
    result = CliRunner().invoke(cli, [str(a) for a in args], env={"CORP_DEPLOY_STATE_DIR": str(state)})
    return result.exit_code, result.output, result.exception


def setting(args: list, option: str, value, aliases: tuple[str, ...] = ()) -> list:
    """``args`` with ``option`` (or one of its ``aliases``, e.g. ``-o`` for ``--output``) set to
    ``value``: replaced where ``args`` give it, else appended (the CLI refuses an option of one
    value given twice)."""
    for i, arg in enumerate(args):
        if arg == option or arg in aliases:
            return [*args[:i], option, value, *args[i + 2 :]]
    return [*args, option, value]


def model_arg(args: list, pair: str) -> list:
    """``args`` with ``--model-arg KEY=VALUE`` replacing the one of that key (each key once, as the CLI
    requires)."""
    key, out, tokens = pair.partition("=")[0] + "=", [], iter(args)
    for arg in tokens:
        value = next(tokens) if arg == "--model-arg" else None
        if value is None:
            out.append(arg)
        elif not value.startswith(key):
            out += [arg, value]
    return [*out, "--model-arg", pair]


def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under ``root`` with its content hash (folders: ``dir``)."""
    out = {}
    for path in sorted(root.rglob("*")):
        key = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[key] = "link:" + os.readlink(path)
        elif path.is_dir():
            out[key] = "dir"
        else:
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def debris(root: Path) -> list[str]:
    """Staging or old-output folders and temporary files anywhere under ``root``."""
    return [
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if re.match(r"\..*\.(tmp|old)-", p.name) or p.name.startswith(".corp-deploy-probe-")
    ]


def assert_one_message(code: int, text: str, exception, expected_code: int, message: str) -> None:
    assert code == expected_code, text
    assert message in text, text
    assert "Traceback" not in text, text
    assert isinstance(exception, (SystemExit, type(None))), repr(exception)
    if expected_code in (1, 2, 5):
        assert text.count("Error:") == 1, text


def png(path: Path, size=(40, 50), seed=0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)).save(path)
    return path


def image_folder(path: Path, count: int = 4) -> Path:
    for i in range(count):
        png(path / f"{i}.png", seed=i)
    return path


def plain(path: Path, colours=((0, 0, 0),) * 4) -> Path:
    """A folder of images each of one colour (all black by default)."""
    path.mkdir(parents=True, exist_ok=True)
    for i, colour in enumerate(colours):
        Image.new("RGB", (40, 50), colour).save(path / f"{i}.png")
    return path


def bomb(path: Path) -> Path:
    """A 20000 x 20000 PNG of a few kilobytes: above Pillow's decompression-bomb limit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("1", (20000, 20000)).save(path)
    return path


def rewrite(path: Path, change: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def rerecord(folder: Path, kind: str) -> None:
    """Rewrite ``folder``'s record to match its files: what someone who edits files and record alike does."""
    (folder / RECORD_FILE).unlink()
    write_record(folder, kind)


def flip_byte(path: Path, offset: int = 4000) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def built(tiny_artifact, other_tiny_artifact, tmp_path_factory):
    """A copy of the small compressed artifact with its dense fp32 export inside (``art``), and a
    copy of the second artifact of the same shapes (another seed; ``other``)."""
    root = tmp_path_factory.mktemp("built")
    shutil.copytree(tiny_artifact, root / "art")
    shutil.copytree(other_tiny_artifact, root / "other")
    code, text, _ = invoke(["export", root / "art", "--dense"], root / "state")
    assert code == 0, text
    return root


@pytest.fixture
def work(tmp_path, built, monkeypatch):
    """The case's folder: a copy of the built artifacts, the current directory, and the temporary
    directory of everything run in-process (checked empty afterwards)."""
    w = tmp_path / "w"
    w.mkdir()
    for name in ("art", "other"):
        shutil.copytree(built / name, w / name)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.chdir(w)
    yield w
    assert list(temp.iterdir()) == [], "temporary files left behind"


# ---------------------------------------------------------------- refused inputs
# Each case: the command line (built in the case's folder ``w``), the exit status, a part of the
# one message. Every file under ``w`` must be unchanged afterwards and nothing may be added.


class Refusal(NamedTuple):
    args: Callable[[Path], list]
    code: int
    message: str
    hide_cuda: bool = False  # run as on a machine without a GPU (the case is about its absence)


def _checkpoint(w: Path, change: Callable[[dict], dict], suffix=".safetensors") -> Path:
    from safetensors.torch import save_file

    state = build_small_vit().state_dict()
    path = w / f"weights{suffix}"
    state = change(state)
    if suffix == ".safetensors":
        save_file(state, str(path))
    else:
        torch.save(state, path)
    return path


def _other_size(state):
    import timm

    return timm.create_model(
        "deit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=96, depth=2, num_heads=3
    ).state_dict()


def _nan_weight(state):
    state["blocks.0.mlp.fc1.weight"][0, 0] = float("nan")
    return state


class _Exploit:
    """A pickle that would create a file when unpickled (``weights_only=True`` must refuse it)."""

    def __reduce__(self):
        return (os.mkdir, ("pwned",))


def _malicious(w: Path) -> Path:
    path = w / "weights.pth"
    torch.save({"model": _Exploit()}, path)
    return path


def _foreign(w: Path, marker: str) -> Path:
    folder = w / "mine"
    folder.mkdir()
    (folder / marker).write_text("{}")
    (folder / "thesis.tex").write_text("years of work")
    return folder


def _with_user_file(folder: Path) -> Path:
    (folder / "notes.txt").write_text("mine")
    return folder


def _old_format(w: Path) -> Path:
    art = w / "art"
    (art / RECORD_FILE).unlink()
    rewrite(art / "config.json", lambda c: c.update(format_version=1))
    return art


def _escaping_manifest(w: Path) -> Path:
    export = w / "art" / "export-fp32"
    shutil.copy(export / "model.onnx", w / "model.onnx")
    rewrite(export / "export.json", lambda m: m["models"]["model"].update(onnx=["../../model.onnx"]))
    rerecord(export, "export")
    return w / "art"


def _record_naming_outside_files(w: Path) -> Path:
    """An artifact whose record also lists files outside it (a crafted record): replacing it must not
    delete them."""
    (w / "victim.txt").write_text("precious")
    rewrite(
        w / "art" / RECORD_FILE,
        lambda r: r["files"].update(
            {"../victim.txt": {"bytes": 8, "sha256": "0" * 64}, str(w / "victim.txt"): {"bytes": 8, "sha256": "0" * 64}}
        ),
    )
    return w / "art"


def _moved_bench_report(w: Path) -> Path:
    """An artifact holding a bench report folder moved into it by hand: replacing the artifact would
    remove the report with it."""
    with staged_output(w / "b", "bench") as folder:
        (folder / "bench.json").write_text("{}")
    shutil.move(w / "b", w / "art" / "b")
    return w / "art"


def _killed_run_left(folder: Path) -> Path:
    """What a run killed with SIGKILL while exporting into ``folder`` leaves: its working folder."""
    (folder / ".export-fp32.tmp-k1ll3d").mkdir()
    (folder / ".export-fp32.tmp-k1ll3d" / "model.onnx").write_bytes(b"half")
    return folder


def _weights_with_nan(w: Path) -> Path:
    """The artifact ``w/art`` with one weight NaN and its record rewritten to match (as a broken
    training or hand edit would leave it, record and all)."""
    from safetensors.torch import load_file, save_file

    weights = w / "art" / "model.safetensors"
    state = load_file(str(weights))
    state[next(key for key, tensor in state.items() if tensor.is_floating_point())].view(-1)[0] = float("nan")
    save_file(state, str(weights))
    write_record(w / "art", "artifact")
    return w / "art"


def _sparse_checkpoint(w: Path) -> Path:
    path = w / "sparse.pth"
    torch.save({k: v.to_sparse() if v.ndim == 2 else v for k, v in build_small_vit().state_dict().items()}, path)
    return path


def _edited_with_record(folder: Path, name: str, kind: str, change: Callable[[dict], None]) -> Path:
    rewrite(folder / name, change)
    rerecord(folder, kind)
    return folder


def _symlink_loop(w: Path) -> Path:
    (w / "loop1").symlink_to(w / "loop2")
    (w / "loop2").symlink_to(w / "loop1")
    return w / "loop1"


def _moved_export(w: Path) -> Path:
    shutil.copytree(w / "art" / "export-fp32", w / "other" / "export-fp32")
    return w / "other"


def _baseline(w: Path, change: Callable[[dict], None] | None = None, text: str | None = None) -> Path:
    path = w / "baseline.json"
    report = {
        "format": "corp-deploy-bench",
        "latency": [{"backend": "ort-cpu", "batch": 1, "compressed": {"p50_s": 0.01}, "speedup": {"median": 1.2}}],
        "fidelity": {"top1_agreement": 0.9, "feature_cosine": 0.95, "accuracy": None},
    }
    if change:
        change(report)
    path.write_text(text if text is not None else json.dumps(report))
    return path


def _weights_as_link(w: Path) -> Path:
    """A copy of ``w/art`` whose weights file is a symbolic link to the same bytes elsewhere."""
    art = w / "linked"
    shutil.copytree(w / "art", art)
    (art / "model.safetensors").rename(w / "weights-elsewhere.safetensors")
    (art / "model.safetensors").symlink_to(w / "weights-elsewhere.safetensors")
    return art


def _of_model(w: Path, **compressed) -> Callable[[dict], None]:
    """A change of a baseline: its compressed model recorded with ``compressed`` (params, macs,
    precision, exporter, opset) in place of ``w/art``'s (read from it, so that only what is given differs)."""

    def change(report: dict) -> None:
        from benchmarks.harness import model_entries
        from benchmarks.targets import load_models

        entries = model_entries(*reversed(load_models(w / "art", w / "art" / "export-fp32")))
        report["models"] = {name: entry.to_dict() for name, entry in entries.items()}
        report["models"]["compressed"].update(compressed)

    return change


def _with_int8(report: dict) -> None:
    report["int8"] = {
        "latency": [{"batch": 1, "speedup_over_dense_fp32": {"compressed-int8": {"median": 2.0}}}],
        "fidelity": {"compressed-int8": {"cosine_mean": 0.99}},
    }


def _backbone(w: Path) -> Path:
    code, text, _ = invoke([*BASE, "--model-arg", "num_classes=0", "-o", w / "backbone"], w.parent / "state")
    assert code == 0, text
    return w / "backbone"


def _labelled(w: Path, mapping: dict | str) -> Path:
    root = w / "val"
    image_folder(root / "cats", 2)
    (root / "class_index.json").write_text(mapping if isinstance(mapping, str) else json.dumps(mapping))
    return root


def _latest(w: Path, text: str) -> None:
    state = w.parent / "state"
    state.mkdir(exist_ok=True)
    (state / "latest.json").write_text(text)


#: A name that is not valid UTF-8 (a Latin-1 "y" with diaeresis, as an older system writes it).
NOT_UTF8 = os.fsdecode(b"caf\xff")


def _renamed_not_utf8(w: Path) -> Path:
    """A copy of the artifact under a name that is not valid UTF-8."""
    return shutil.copytree(w / "art", w / NOT_UTF8)


def _broken_images(w: Path) -> Path:
    folder = w / "broken"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"\x89PNG not really")
    (folder / "b.jpg").write_bytes(b"")
    return folder


def _recorded_calib_gone(w: Path) -> Path:
    calib = image_folder(w / "calib")
    code, text, _ = invoke([*BASE, "--calib", calib, "-o", w / "calibrated"], w.parent / "state")
    assert code == 0, text
    shutil.rmtree(calib)
    return w / "calibrated"


REFUSALS: dict[str, Refusal] = {
    # compress: settings
    "compress-cuda-without-gpu": Refusal(
        lambda w: [*BASE, "--device", "cuda", "-o", w / "o"], 1, "no CUDA GPU is available", hide_cuda=True
    ),
    "compress-unknown-model": Refusal(lambda w: ["compress", "no_such_vit", "-o", w / "o"], 1, "unknown model"),
    "compress-sparsity-out-of-range": Refusal(
        lambda w: [*BASE, "--s", 1.5, "-o", w / "o"], 2, "--s must be in [0, 1), got 1.5"
    ),
    "compress-sparsity-nan": Refusal(lambda w: [*BASE, "--s", "nan", "-o", w / "o"], 2, "--s must be in [0, 1)"),
    "compress-macs-inf": Refusal(
        lambda w: [*BASE, "--macs", "inf", "-o", w / "o"], 2, "--macs must be a fraction of the dense MACs"
    ),
    "compress-speedup-nan": Refusal(
        lambda w: [*BASE, "--speedup", "nan", "-o", w / "o"], 2, "--speedup must be a finite number >= 1"
    ),
    "compress-ridge-nan": Refusal(
        lambda w: [*BASE, "--ridge", "nan", "-o", w / "o"], 2, "--ridge must be a finite number >= 0"
    ),
    "compress-unit-floor-nan": Refusal(
        lambda w: [*BASE, "--macs", 0.5, "--unit-floor", "nan", "-o", w / "o"], 2, "--unit-floor must be in [0, 1]"
    ),
    "compress-round-to-larger-than-a-layer": Refusal(
        lambda w: [*BASE, "--round-to", 64, "-o", w / "o"],
        2,
        "--round-to 64 is larger than the 16 query/key dims per head",
    ),
    "compress-round-to-prunes-nothing": Refusal(
        lambda w: [*BASE, "--s", 0.1, "--round-to", 8, "-o", w / "o"],
        2,
        "--s 0.1 keeps all 16 query/key dims per head of block 0",  # the option typed, not --s-attn
    ),
    "compress-sparsity-that-rounds-to-nothing": Refusal(
        lambda w: [*BASE, "--target", "mlp", "--s-mlp", 0.002, "-o", w / "o"],
        2,
        "--s-mlp 0.002 keeps all 192 MLP hidden channels of block 0 (0.002 x 192 = 0.384 rounds to none removed)",
    ),
    "compress-vbp-rate-that-removes-nothing": Refusal(
        lambda w: [*BASE, "--method", "vbp", "--s-mlp", 0.001, "-o", w / "o"],
        2,
        "--s-mlp 0.001 keeps all 384 MLP hidden channels of the model",
    ),
    "compress-recover-batch-size-beyond-its-range": Refusal(
        lambda w: [*BASE, "--recover-steps", 2, "--recover-batch-size", 100000, "-o", w / "o"],
        2,
        "--recover-batch-size must be an integer from 1 to 4,096",
    ),
    "compress-recovery-of-the-dense-model": Refusal(
        lambda w: [*BASE, "--s", 0, "--recover-steps", 2, "-o", w / "o"],
        2,
        "--recover-steps recovers what compression lost, and every sparsity is 0: the model is the dense one",
    ),
    "compress-recovery-of-a-budget-the-dense-model-fits": Refusal(
        lambda w: [*BASE, "--speedup", 1, "--recover-steps", 2, "-o", w / "o"],
        2,
        "--recover-steps recovers what compression lost, and the MAC budget --speedup 1 keeps every dim",
    ),
    "compress-recover-steps-that-never-end": Refusal(
        lambda w: [*BASE, "--recover-steps", 10**12, "-o", w / "o"],
        2,
        "--recover-steps must be an integer from 0 to 1,000,000",
    ),
    "compress-model-arg-negative-num-classes": Refusal(
        lambda w: [*BASE, "--model-arg", "num_classes=-5", "-o", w / "o"], 1, "num_classes must not be negative"
    ),
    "compress-model-arg-negative-in-a-list": Refusal(
        lambda w: [*model_arg(BASE, "img_size=[32,-32]"), "-o", w / "o"], 1, "img_size must not be negative"
    ),
    "compress-calib-empty-string": Refusal(lambda w: [*BASE, "--calib", "", "-o", w / "o"], 2, "an empty path"),
    "compress-o-empty-string": Refusal(lambda w: [*BASE, "-o", ""], 2, "an empty path"),
    "compress-o-not-utf-8": Refusal(lambda w: [*BASE, "-o", w / NOT_UTF8], 2, "caf\\xff is not valid UTF-8"),
    "compress-calib-not-utf-8": Refusal(
        lambda w: [*BASE, "--calib", image_folder(w / NOT_UTF8), "-o", w / "o"], 2, "caf\\xff is not valid UTF-8"
    ),
    "compress-seed-too-large": Refusal(lambda w: [*BASE, "--seed", 2**70, "-o", w / "o"], 2, "--seed"),
    "compress-zero-calibration-samples": Refusal(
        lambda w: [*setting(BASE, "--calib-samples", 0), "-o", w / "o"], 2, "--calib-samples"
    ),
    "compress-zero-batch-size": Refusal(lambda w: [*BASE, "--batch-size", 0, "-o", w / "o"], 2, "--batch-size"),
    "compress-budget-and-sparsity": Refusal(
        lambda w: [*BASE, "--macs", 0.6, "--s", 0.5, "-o", w / "o"], 2, "exclude each other"
    ),
    "compress-option-of-another-method": Refusal(
        lambda w: [*BASE, "--method", "vbp", "--s-attn", 0.5, "-o", w / "o"], 2, "--s-attn has no meaning"
    ),
    # compress: calibration images
    "compress-calib-missing": Refusal(lambda w: [*BASE, "--calib", w / "nope", "-o", w / "o"], 1, "nope: not found"),
    "compress-calib-is-a-file": Refusal(
        lambda w: [*BASE, "--calib", png(w / "a.png"), "-o", w / "o"], 1, "a.png: not a directory"
    ),
    "compress-calib-empty": Refusal(
        lambda w: [*BASE, "--calib", (w / "empty").mkdir() or w / "empty", "-o", w / "o"], 1, "no images"
    ),
    "compress-calib-all-unreadable": Refusal(
        lambda w: [*BASE, "--calib", _broken_images(w), "-o", w / "o"], 1, "none of the 2 image files could be read"
    ),
    "compress-calib-only-a-decompression-bomb": Refusal(
        lambda w: [*BASE, "--calib", bomb(w / "b" / "big.png").parent, "-o", w / "o"], 1, "decompression-bomb limit"
    ),
    "compress-calib-all-black": Refusal(
        lambda w: [*BASE, "--calib", plain(w / "black"), "-o", w / "o"],
        1,
        "all 4 calibration images are of one colour (e.g. all black): no patch differs from another but by its "
        "position, so the statistics calibration gathers over them are singular",
    ),
    "compress-calib-of-one-colour-each": Refusal(
        lambda w: [*BASE, "--calib", plain(w / "plain", [(0, 0, 0), (255, 255, 255), (200, 30, 30)]), "-o", w / "o"],
        1,
        "all 4 calibration images are of one colour",  # the 3 files, and a crop of one to fill --calib-samples 4
    ),
    # compress: weights and models
    "compress-checkpoint-missing": Refusal(
        lambda w: [*BASE[:2], *TINY, "--checkpoint", w / "w.pth", "-o", w / "o"], 1, "w.pth: not found"
    ),
    "compress-checkpoint-of-another-size": Refusal(
        lambda w: [*BASE[:2], *TINY, "--checkpoint", _checkpoint(w, _other_size), "-o", w / "o"],
        1,
        "tensors of other shapes (e.g. cls_token: [1, 1, 96] in the checkpoint, [1, 1, 48] in the model)",
    ),
    "compress-checkpoint-with-nan": Refusal(
        lambda w: [*BASE[:2], *TINY, "--checkpoint", _checkpoint(w, _nan_weight), "-o", w / "o"],
        1,
        "blocks.0.mlp.fc1.weight holds NaN or infinite values",
    ),
    "compress-checkpoint-garbage": Refusal(
        lambda w: [
            *BASE[:2],
            *TINY,
            "--checkpoint",
            (w / "g.safetensors").write_bytes(b"xx") and w / "g.safetensors",
            "-o",
            w / "o",
        ],
        1,
        "cannot read checkpoint",
    ),
    "compress-checkpoint-of-text": Refusal(
        lambda w: [*BASE[:2], *TINY, "--checkpoint", (w / "t.pth").write_text("x\n") and w / "t.pth", "-o", w / "o"],
        1,
        "it is neither a safetensors file nor a PyTorch file",
    ),
    "compress-checkpoint-pickle-exploit": Refusal(
        lambda w: [*BASE[:2], *TINY, "--checkpoint", _malicious(w), "-o", w / "o"], 1, "cannot read checkpoint"
    ),
    "compress-checkpoint-and-random-weights": Refusal(
        lambda w: [*BASE, "--checkpoint", _checkpoint(w, lambda s: s), "-o", w / "o"], 2, "exclude each other"
    ),
    "compress-model-arg-depth-0": Refusal(
        lambda w: [*model_arg(BASE, "depth=0"), "-o", w / "o"], 1, "no transformer blocks"
    ),
    "compress-model-arg-patch-larger-than-image": Refusal(
        lambda w: [*model_arg(BASE, "patch_size=1000"), "-o", w / "o"], 1, "patch grid is (0, 0)"
    ),
    "compress-model-arg-timm-refuses": Refusal(
        lambda w: [*model_arg(BASE, "embed_dim=50"), "-o", w / "o"],
        1,
        "timm cannot build deit_tiny_patch16_224 with",
    ),
    "compress-option-given-twice": Refusal(
        lambda w: [*BASE, "--s=0.5", "--s", 0.7, "-o", w / "o"],
        2,
        "--s is given more than once (--s 0.5, then --s 0.7)",
    ),
    "compress-model-arg-key-given-twice": Refusal(
        lambda w: [*BASE, "--model-arg", "depth=3", "-o", w / "o"], 2, "--model-arg depth is given more than once"
    ),
    "compress-model-arg-a-yes-no-word": Refusal(
        lambda w: [*BASE, "--model-arg", "qkv_bias=no", "-o", w / "o"], 2, "write a yes/no value as true or false"
    ),
    "bench-backends-repeated": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--backends", "torch,torch"],
        2,
        "takes one or more of torch,torch-compile,ort,trt, each once",
    ),
    "bench-batch-empty-item": Refusal(
        lambda w: ["bench", w / "art", *setting(BENCH, "--batch", "1,,2")], 2, "takes comma-separated positive"
    ),
    "sweep-budgets-with-a-method-that-takes-none": Refusal(
        lambda w: ["sweep", *BASE[1:], "--macs", 0.6, "--methods", "corp,vbp", "-o", w / "o"],
        2,
        "--macs applies to --methods corp and uncompensated only, not vbp",
    ),
    "bench-gate-trailing-comma": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--baseline", _baseline(w), "--gate", "speedup,"],
        2,
        "takes comma-separated gate names (e.g. speedup,fidelity); got 'speedup,': an empty item is refused",
    ),
    "bench-gate-leading-comma": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--baseline", _baseline(w), "--gate", ",speedup"],
        2,
        "an empty item is refused, not dropped",
    ),
    "bench-backends-empty-item": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--backends", "torch,"], 2, "an empty item is refused, not dropped"
    ),
    "sweep-methods-empty-item": Refusal(
        lambda w: ["sweep", *BASE[1:], "--methods", "corp,,vbp", "-o", w / "o"],
        2,
        "takes comma-separated method names (e.g. corp,vbp); got 'corp,,vbp'",
    ),
    "bench-baseline-without-the-feature-cosine-it-gates": Refusal(
        lambda w: [
            "bench",
            w / "art",
            *BENCH,
            "--backends",
            "ort",
            "--baseline",
            _baseline(w, lambda r: r["fidelity"].update(feature_cosine=None)),
            "--gate",
            "fidelity",
        ],
        4,
        "fidelity: feature cosine was measured but the baseline has none (null or missing)",
    ),
    "sweep-sparsity-trailing-comma": Refusal(
        lambda w: ["sweep", *BASE[1:], "--s", "0.5,", "-o", w / "o"], 2, "takes comma-separated numbers"
    ),
    "compress-flag-given-twice": Refusal(
        lambda w: [*BASE, "--no-compensation", "--no-compensation", "-o", w / "o"], 2, "--no-compensation is given more"
    ),
    "bench-option-given-twice": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--batch", 2, "-o", w / "o"], 2, "--batch is given more than once"
    ),
    "compress-model-arg-malformed": Refusal(lambda w: [*BASE, "--model-arg", "depth", "-o", w / "o"], 2, "KEY=VALUE"),
    # compress: outputs
    "compress-o-foreign-folder-with-config-json": Refusal(
        lambda w: [*BASE, "-o", _foreign(w, "config.json")],
        1,
        "holds no corp-deploy-record.json that corp-deploy can read",
    ),
    "compress-o-is-a-file": Refusal(lambda w: [*BASE, "-o", png(w / "a.png")], 1, "exists and is not a directory"),
    "compress-o-below-a-file": Refusal(
        lambda w: [*BASE, "-o", png(w / "a.png") / "out"], 1, "a.png is a file, not a directory"
    ),
    "compress-o-current-directory": Refusal(lambda w: [*BASE, "-o", "."], 1, "is the current directory"),
    "compress-o-name-too-long": Refusal(lambda w: [*BASE, "-o", w / ("x" * 300)], 1, "the name is 300 bytes long"),
    "compress-o-not-writable": Refusal(lambda w: [*BASE, "-o", "/proc/corp-deploy-test"], 1, "cannot create"),
    "compress-o-own-artifact-with-a-user-file": Refusal(
        lambda w: [*BASE, "-o", _with_user_file(w / "art")], 1, "notes.txt was not written by corp-deploy"
    ),
    "compress-o-own-artifact-changed": Refusal(
        lambda w: [*BASE, "-o", (w / "art" / "report.json").write_text("{}") and w / "art"],
        1,
        "report.json has changed since corp-deploy wrote it",
    ),
    "compress-o-own-export": Refusal(
        lambda w: [*BASE, "-o", w / "art" / "export-fp32"], 1, "it holds an export, not an artifact"
    ),
    "compress-o-record-naming-files-outside-it": Refusal(
        lambda w: [*BASE, "-o", _record_naming_outside_files(w)],
        1,
        "holds no corp-deploy-record.json that corp-deploy can read",
    ),
    "compress-o-symlink-loop": Refusal(lambda w: [*BASE, "-o", _symlink_loop(w)], 1, "loop1 cannot be resolved"),
    "compress-o-inside-calib": Refusal(
        lambda w: [*BASE, "--calib", image_folder(w / "calib"), "-o", w / "calib" / "o"], 1, "lies inside --calib"
    ),
    "compress-o-the-state-folder": Refusal(lambda w: [*BASE, "-o", w.parent / "state"], 1, "state lies inside"),
    "compress-model-arg-the-model-cannot-run": Refusal(
        lambda w: [*BASE, "--model-arg", "drop_rate=NaN", "-o", w / "o"],
        1,
        "cannot run on an image: dropout probability",
    ),
    "compress-checkpoint-of-sparse-tensors": Refusal(
        lambda w: [*BASE[:2], *TINY, "--checkpoint", _sparse_checkpoint(w), "-o", w / "o"],
        1,
        "does not hold a state dict of dense tensors",
    ),
    "compress-o-export-with-a-user-file-inside": Refusal(
        lambda w: [*BASE, "-o", _with_user_file(w / "art" / "export-fp32").parent],
        1,
        "notes.txt was not written by corp-deploy",
    ),
    "compress-o-inside-an-artifact": Refusal(
        lambda w: [*BASE, "-o", w / "art" / "sub"], 1, "art/sub lies inside {w}/art, an output of corp-deploy"
    ),
    "compress-o-deep-inside-an-export": Refusal(
        lambda w: [*BASE, "-o", w / "art" / "export-fp32" / "x" / "y"], 1, "lies inside {w}/art/export-fp32, an output"
    ),
    "compress-o-own-artifact-holding-a-moved-bench-report": Refusal(
        lambda w: [*BASE, "-o", _moved_bench_report(w)],
        1,
        "b is a bench report, which corp-deploy never writes inside an artifact",
    ),
    "compress-o-own-artifact-with-a-killed-runs-working-folder": Refusal(
        lambda w: [*BASE, "-o", _killed_run_left(w / "art")],
        1,
        "is the working folder of a corp-deploy run that was killed or is still running",
    ),
    "recover-o-the-artifact-itself": Refusal(
        lambda w: ["recover", w / "art", "-o", w / "art"], 1, "{w}/art is ARTIFACT itself, which this command reads"
    ),
    "recover-o-inside-another-artifact": Refusal(
        lambda w: ["recover", w / "art", "-o", w / "other" / "rec"], 1, "lies inside {w}/other, an output"
    ),
    "export-o-inside-another-artifact": Refusal(
        lambda w: ["export", w / "art", "-o", w / "other" / "export-fp32"],
        1,
        "an export goes inside the artifact it is made from",
    ),
    "export-o-inside-an-export": Refusal(
        lambda w: ["export", w / "art", "-o", w / "art" / "export-fp32" / "e"], 1, "lies inside {w}/art/export-fp32"
    ),
    "bench-o-inside-an-export": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "-o", w / "art" / "export-fp32" / "b"],
        1,
        "lies inside {w}/art/export-fp32, an output",
    ),
    "sweep-o-inside-an-artifact": Refusal(
        lambda w: ["sweep", *BASE[1:], "--s", 0.5, "-o", w / "art" / "sweep"], 1, "lies inside {w}/art, an output"
    ),
    # export: the artifact read
    "export-weights-holding-nan-with-a-matching-record": Refusal(
        lambda w: ["export", _weights_with_nan(w), "-o", w / "o"], 1, "holds NaN or infinite values; no export"
    ),
    "export-flipped-weight-byte": Refusal(
        lambda w: flip_byte(w / "art" / "model.safetensors") or ["export", w / "art", "-o", w / "o"],
        1,
        "model.safetensors does not match the SHA-256",
    ),
    "export-edited-config": Refusal(
        lambda w: (
            rewrite(w / "art" / "config.json", lambda c: c["blocks"][0].update(scale=0.5))
            or ["export", w / "art", "-o", w / "o"]
        ),
        1,
        "config.json does not match the SHA-256",
    ),
    "export-weights-of-another-artifact": Refusal(
        lambda w: (
            shutil.copy(w / "other" / "model.safetensors", w / "art" / "model.safetensors")
            and ["export", w / "art", "-o", w / "o"]
        ),
        1,
        "model.safetensors does not match the SHA-256",
    ),
    "export-record-removed": Refusal(
        lambda w: (w / "art" / RECORD_FILE).unlink() or ["export", w / "art", "-o", w / "o"],
        1,
        "has no readable corp-deploy-record.json",
    ),
    "export-record-not-an-object": Refusal(
        lambda w: (w / "art" / RECORD_FILE).write_text("[]") and ["export", w / "art", "-o", w / "o"],
        1,
        "has no readable corp-deploy-record",
    ),
    "export-config-edited-with-its-record": Refusal(
        lambda w: [
            "export",
            _edited_with_record(w / "art", "config.json", "artifact", lambda c: c.update(blocks="x")),
            "-o",
            w / "o",
        ],
        1,
        "config.json is malformed: blocks needs one object per block",
    ),
    "export-config-of-another-input-size-with-its-record": Refusal(
        lambda w: [
            "export",
            _edited_with_record(
                w / "art", "config.json", "artifact", lambda c: c["input"].update(input_size=[3, 64, 64])
            ),
            "-o",
            w / "o",
        ],
        1,
        "config.json is malformed: input.input_size [3, 64, 64] is not the input size of the model it describes "
        "([3, 32, 32])",
    ),
    "bench-config-of-another-input-size-with-its-record": Refusal(
        lambda w: (
            shutil.rmtree(w / "art" / "export-fp32")
            or [
                "bench",
                _edited_with_record(
                    w / "art", "config.json", "artifact", lambda c: c["input"].update(input_size=[3, 64, 64])
                ),
                *BENCH,
            ]
        ),
        1,
        "config.json is malformed: input.input_size [3, 64, 64] is not the input size of the model it describes",
    ),
    "export-config-unbuildable-with-its-record": Refusal(
        lambda w: [
            "export",
            _edited_with_record(
                w / "art", "config.json", "artifact", lambda c: c["blocks"][0].update(mlp_hidden=10**30)
            ),
            "-o",
            w / "o",
        ],
        1,
        "config.json does not describe a model this corp-deploy can rebuild",
    ),
    "export-config-of-other-sizes-than-its-weights-with-its-record": Refusal(
        lambda w: [
            "export",
            _edited_with_record(
                w / "art",
                "config.json",
                "artifact",
                lambda c: c["blocks"][0].update(mlp_hidden=c["blocks"][0]["mlp_hidden"] + 1),
            ),
            "-o",
            w / "o",
        ],
        1,
        "do not match its config.json: 3 tensors of other shapes (e.g. blocks.0.mlp.fc1.weight: [96, 48] in model",
    ),
    "export-workspace-too-large": Refusal(
        lambda w: ["export", w / "art", "--trt", "--workspace", "1e308", "-o", w / "o"],
        2,
        "--workspace must be a number of GB from",
    ),
    "export-calib-samples-absurd": Refusal(
        lambda w: ["export", w / "art", "--precision", "int8", "--calib-samples", 10**20, "-o", w / "o"],
        2,
        "--calib-samples",
    ),
    "export-artifact-of-format-1": Refusal(
        lambda w: ["export", _old_format(w), "-o", w / "o"], 1, "artifact format version 1 is not supported"
    ),
    "export-artifact-is-a-file": Refusal(
        lambda w: ["export", png(w / "a.png"), "-o", w / "o"], 1, "is not a corp-deploy artifact (not a directory)"
    ),
    "export-artifact-not-utf-8": Refusal(
        lambda w: ["export", _renamed_not_utf8(w), "-o", w / "o"], 2, "caf\\xff is not valid UTF-8"
    ),
    "recover-latest-record-of-an-artifact-not-utf-8": Refusal(
        lambda w: _latest(w, json.dumps({"artifact": str(_renamed_not_utf8(w))})) or ["recover", "-o", w / "o"],
        1,
        "records it) cannot be used: path {w}/caf\\xff is not valid UTF-8",
    ),
    "export-latest-record-malformed": Refusal(
        lambda w: _latest(w, "{oops") or ["export", "-o", w / "o"],
        1,
        "latest.json is not a corp-deploy state record (malformed JSON)",
    ),
    "export-latest-record-of-a-removed-artifact": Refusal(
        lambda w: _latest(w, json.dumps({"artifact": str(w / "gone")})) or ["export", "-o", w / "o"],
        1,
        "latest.json records it) cannot be used: {w}/gone is not a corp-deploy artifact (not found); pass the",
    ),
    "export-latest-record-without-its-artifact": Refusal(
        lambda w: _latest(w, '{"path": "/x"}') or ["export", "-o", w / "o"],
        1,
        'latest.json is not a corp-deploy state record (no "artifact" path in it)',
    ),
    "export-latest-record-points-nowhere": Refusal(
        lambda w: _latest(w, json.dumps({"artifact": str(w / "gone")})) or ["export", "-o", w / "o"],
        1,
        "gone is not a corp-deploy artifact",
    ),
    # export: settings and outputs
    "export-o-foreign-folder-with-export-json": Refusal(
        lambda w: ["export", w / "art", "-o", _foreign(w, "export.json")],
        1,
        "holds no corp-deploy-record.json that corp-deploy can read",
    ),
    "export-default-folder-with-a-user-file": Refusal(
        lambda w: _with_user_file(w / "art" / "export-fp32") and ["export", w / "art"],
        1,
        "notes.txt was not written by corp-deploy",
    ),
    "export-o-own-artifact": Refusal(
        lambda w: ["export", w / "art", "-o", w / "other"], 1, "it holds an artifact, not an export"
    ),
    "export-opset-too-high": Refusal(
        lambda w: ["export", w / "art", "--opset", 99, "-o", w / "o"], 2, "--opset must be between 17 and"
    ),
    "export-opset-beyond-torchscript": Refusal(
        lambda w: ["export", w / "art", "--exporter", "torchscript", "--opset", 24, "-o", w / "o"],
        2,
        "with the torchscript exporter",
    ),
    "export-int8-calib-missing": Refusal(
        lambda w: ["export", w / "art", "--precision", "int8", "--calib", w / "nope", "-o", w / "o"],
        1,
        "--calib " + "{w}/nope: not found",
    ),
    "export-int8-calib-all-black": Refusal(
        lambda w: ["export", w / "art", "--precision", "int8", "--calib", plain(w / "black"), "-o", w / "o"],
        1,
        "all 16 calibration images are of one colour",  # 4 files filled with crops to the artifact's 16
    ),
    "export-o-inside-calib": Refusal(
        lambda w: [
            "export",
            w / "art",
            "--precision",
            "int8",
            "--calib",
            image_folder(w / "calib"),
            "-o",
            w / "calib" / "o",
        ],
        1,
        "lies inside --calib",
    ),
    "export-int8-keep-float-as-many-as-the-layers": Refusal(
        lambda w: ["export", w / "art", "--precision", "int8", "--int8-keep-float", 1000, "-o", w / "o"],
        2,
        "--int8-keep-float 1000 would keep all",
    ),
    "export-int8-option-without-int8": Refusal(
        lambda w: ["export", w / "art", "--calib-samples", 4, "-o", w / "o"],
        2,
        "--calib-samples applies only with --precision int8",
    ),
    "export-int8-recorded-calibration-gone": Refusal(
        lambda w: ["export", _recorded_calib_gone(w), "--precision", "int8", "-o", w / "o"],
        1,
        "which is not there any more",
    ),
    "export-workspace-nan": Refusal(
        lambda w: ["export", w / "art", "--workspace", "nan", "-o", w / "o"],
        2,
        "--workspace must be a number of GB from",
    ),
    "export-atol-nan": Refusal(
        lambda w: ["export", w / "art", "--atol", "nan", "-o", w / "o"], 2, "--atol must be a finite number >= 0"
    ),
    "export-min-cosine-out-of-range": Refusal(
        lambda w: ["export", w / "art", "--min-cosine", 2, "-o", w / "o"], 2, "--min-cosine must be in [-1, 1]"
    ),
    "export-timing-cache-is-a-directory": Refusal(
        lambda w: ["export", w / "art", "--trt", "--timing-cache", w / "art", "-o", w / "o"],
        1,
        "a directory, not a file",
    ),
    "export-timing-cache-inside-another-output": Refusal(
        lambda w: ["export", w / "art", "--trt", "--timing-cache", w / "other" / "trt.cache", "-o", w / "o"],
        1,
        "trt.cache lies inside {w}/other, an output of corp-deploy",
    ),
    "export-timing-cache-inside-the-export": Refusal(
        lambda w: ["export", w / "art", "--trt", "--timing-cache", w / "art" / "export-fp32" / "t.cache"],
        1,
        "t.cache lies inside {w}/art/export-fp32, an output of corp-deploy",
    ),
    "export-batch-profile-backwards": Refusal(
        lambda w: ["export", w / "art", "--batch", "8:4:2", "-o", w / "o"], 2, "1 <= MIN <= OPT <= MAX"
    ),
    # bench
    "bench-corrupted-onnx": Refusal(
        lambda w: (
            flip_byte(w / "art" / "export-fp32" / "model.onnx") or ["bench", w / "art", *BENCH, "--json", w / "r.json"]
        ),
        1,
        "model.onnx does not match the SHA-256",
    ),
    "bench-manifest-path-outside-the-export": Refusal(
        lambda w: ["bench", _escaping_manifest(w), *BENCH], 1, "../../model.onnx is not listed"
    ),
    "bench-export-manifest-corrupted": Refusal(
        lambda w: (w / "art" / "export-fp32" / "export.json").write_text("{oops") and ["bench", w / "art", *BENCH],
        1,
        "export.json does not match the SHA-256",
    ),
    "bench-manifest-edited-with-its-record": Refusal(
        lambda w: (
            _edited_with_record(w / "art" / "export-fp32", "export.json", "export", lambda m: m.update(models={}))
            and ["bench", w / "art", *BENCH]
        ),
        1,
        "export.json is malformed: models needs the compressed model",
    ),
    "bench-export-of-another-artifact": Refusal(
        lambda w: ["bench", _moved_export(w), *BENCH], 1, "was exported from a different version"
    ),
    "bench-baseline-malformed-json": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--baseline", _baseline(w, text="{not json")], 1, "cannot read baseline"
    ),
    "bench-baseline-zero-latency": Refusal(
        lambda w: [
            "bench",
            w / "art",
            *BENCH,
            "--baseline",
            _baseline(w, lambda r: r["latency"][0]["compressed"].update(p50_s=0)),
        ],
        1,
        "latency row 0 needs a backend name, a batch size and positive finite times",
    ),
    "bench-baseline-missing-keys": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--baseline", _baseline(w, lambda r: r["latency"][0].pop("speedup"))],
        1,
        "latency row 0 lacks",
    ),
    "bench-baseline-is-a-directory": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--baseline", w / "art"], 1, "is a directory, not a bench JSON report"
    ),
    "bench-baseline-nothing-measured": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--backends", "trt", "--baseline", _baseline(w)],
        4,
        "latency: ort-cpu, batch 1 is in the baseline but was not measured",
    ),
    "bench-limit-nothing-measured": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--backends", "torch", "--min-parity-cosine", 0.99],
        4,
        "--min-parity-cosine was given but nothing ran other than the fp32 torch-cpu reference",
        hide_cuda=True,
    ),
    "bench-baseline-of-another-model": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--baseline", _baseline(w, _of_model(w, params=10**6, macs=2 * 10**9))],
        1,
        "compressed model params 1 M in the baseline, ",
    ),
    "bench-baseline-of-another-precision": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--baseline", _baseline(w, _of_model(w, precision="fp16"))],
        1,
        "compressed model precision fp16 in the baseline, fp32 here",
    ),
    "compress-recovery-options-without-recovery": Refusal(
        lambda w: [*BASE, "--recover-blend", 0.7, "--recover-patience", 2, "-o", w / "o"],
        2,
        "--recover-patience, --recover-blend apply only with --recover-steps N",
    ),
    "compress-unit-floor-without-a-budget": Refusal(
        lambda w: [*BASE, "--unit-floor", 0.5, "-o", w / "o"],
        2,
        "--unit-floor is a floor on the sizes a MAC budget chooses; it applies only with --macs or --speedup",
    ),
    "compress-vbp-layer-floor-that-keeps-every-channel": Refusal(
        lambda w: [*BASE, "--method", "vbp", "--s", 0.5, "--layer-floor", 1.0, "-o", w / "o"],
        2,
        "--layer-floor 1 keeps so many channels of every MLP that at most 0 of the model's 384 MLP hidden channels",
    ),
    "compress-refit-shrink-without-the-refit": Refusal(
        lambda w: [*BASE, "--calibration", "sequential", "--refit-shrink", 3, "-o", w / "o"],
        2,
        "--refit-shrink is the drift refit's ridge; it does nothing without the refit",
    ),
    "bench-an-export-whose-export-json-was-removed": Refusal(
        lambda w: (w / "art" / "export-fp32" / "export.json").unlink() or ["bench", w / "art", *BENCH],
        1,
        "export.json is missing (it is listed in corp-deploy-record.json)",
    ),
    "bench-torch-precision-without-torch": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--backends", "ort", "--torch-precision", "bf16"],
        2,
        "--torch-precision applies only with the torch backends",
    ),
    "bench-cuda-graphs-without-a-gpu": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--backends", "torch", "--cuda-graphs"],
        2,
        "--cuda-graphs replays CUDA graphs on a CUDA GPU, and PyTorch sees none here",
        hide_cuda=True,
    ),
    "export-into-a-folder-named-for-another-precision": Refusal(
        lambda w: ["export", w / "art", "--precision", "fp16", "-o", w / "art" / "export-fp32"],
        1,
        "export-fp32 is named for fp32 graphs, and this export is fp16",
    ),
    "export-min-top1-out-of-range": Refusal(
        lambda w: ["export", w / "art", "--min-top1", 1.5, "-o", w / "o"],
        2,
        "--min-top1 (top-1 agreement) must be in [0, 1]",
    ),
    "export-batch-profile-without-trt": Refusal(
        lambda w: ["export", w / "art", "--batch", "1:2:4", "-o", w / "x"],
        2,
        "--batch is the TensorRT engines' batch profile; it applies only with --trt",
    ),
    "bench-json-to-a-device": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--json", "/dev/null"],
        2,
        "/dev/null is not a file path (a device, pipe or socket)",
    ),
    "bench-a-weights-file-replaced-by-a-link": Refusal(
        lambda w: ["bench", _weights_as_link(w), *BENCH],
        1,
        "model.safetensors is a symbolic link, not the file corp-deploy wrote",
    ),
    "bench-baseline-of-another-export": Refusal(
        lambda w: [
            "bench",
            w / "art",
            *BENCH,
            "--baseline",
            _baseline(w, _of_model(w, exporter="torchscript", opset=17)),
        ],
        1,
        "compressed model exporter torchscript in the baseline, dynamo here; "
        "compressed model opset 17 in the baseline, ",
    ),
    "bench-baseline-whose-fidelity-was-measured-on-other-images": Refusal(
        lambda w: [
            "bench",
            w / "art",
            *BENCH,
            "--baseline",
            _baseline(w, lambda r: r["fidelity"].update(data={"source": "builtin", "images": 64})),
        ],
        1,
        "measured fidelity on other images than this run (images 64 in the baseline, 2 here)",
    ),
    "bench-baseline-of-other-settings-and-other-images": Refusal(
        lambda w: [
            "bench",
            w / "art",
            *BENCH,
            "--baseline",
            _baseline(
                w,
                lambda r: r.update(
                    settings={"batches": [1, 8]},
                    fidelity={**r["fidelity"], "data": {"source": "builtin", "images": 64}},
                ),
            ),
        ],
        1,
        "--batch 1,8 in the baseline, 1 here; fidelity on other images: images 64 in the baseline, 2 here); a gate",
    ),
    "bench-baseline-with-a-cosine-above-one": Refusal(
        lambda w: [
            "bench",
            w / "art",
            *BENCH,
            "--baseline",
            _baseline(w, lambda r: r["fidelity"].update(feature_cosine=1.5)),
        ],
        1,
        "fidelity.feature_cosine 1.5 is outside [-1, 1], where it always lies",
    ),
    "bench-baseline-of-other-batch-sizes-and-backends": Refusal(
        lambda w: [
            "bench",
            w / "art",
            *BENCH,
            "--backends",
            "ort",
            "--baseline",
            _baseline(w, lambda r: r.update(settings={"batches": [1, 8], "backends": ["torch", "ort"]})),
        ],
        1,
        "--batch 1,8 in the baseline, 1 here; --backends torch,ort in the baseline, ort here",
    ),
    "bench-a-row-the-baseline-did-not-time": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--backends", "torch,ort", "--baseline", _baseline(w)],
        4,
        "latency: torch-cpu, batch 1 was measured but is not in the baseline",
    ),
    "bench-min-agreement-nan": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--min-agreement", "nan"],
        2,
        "--min-agreement must be a finite number in [0, 1]",
    ),
    "bench-max-kl-negative": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--max-kl", -1], 2, "--max-kl must be a finite number >= 0"
    ),
    "bench-min-cosine-inf": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--min-cosine", "inf"],
        2,
        "--min-cosine must be a finite number in [-1, 1]",
    ),
    "bench-json-over-a-user-file": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--json", (w / "notes.json").write_text("{}") and w / "notes.json"],
        1,
        "notes.json: it is not a bench json file as corp-deploy wrote it",
    ),
    "bench-json-inside-the-o-folder": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "-o", w / "b", "--json", w / "b" / "r.json"], 1, "r.json lies inside -o"
    ),
    "bench-json-inside-an-output": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--json", w / "art" / "export-fp32" / "r.json"],
        1,
        "an output of corp-deploy, which holds only the files its record lists",
    ),
    "bench-o-inside-data": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--data", image_folder(w / "val"), "-o", w / "val" / "b"],
        1,
        "lies inside --data",
    ),
    "bench-threads-too-many": Refusal(lambda w: ["bench", w / "art", *BENCH, "--threads", 10**20], 2, "--threads"),
    "bench-min-time-nan": Refusal(
        lambda w: ["bench", w / "art", *setting(BENCH, "--min-time", "nan")], 2, "nan is not a finite number"
    ),
    "bench-min-time-beyond-an-hour": Refusal(
        lambda w: ["bench", w / "art", *setting(BENCH, "--min-time", 1e6)], 2, "--min-time"
    ),
    "bench-repeated-batch-size": Refusal(
        lambda w: ["bench", w / "art", *setting(BENCH, "--batch", "1,8,1")], 2, "gives batch size 1 more than once"
    ),
    "bench-data-empty-string": Refusal(lambda w: ["bench", w / "art", *BENCH, "--data", ""], 2, "an empty path"),
    "export-artifact-empty-string": Refusal(lambda w: ["export", "", "-o", w / "o"], 2, "an empty path"),
    "sweep-repeated-batch-size": Refusal(
        lambda w: ["sweep", *BASE[1:], "--s", 0.5, "--batch", "4,4", "-o", w / "o"],
        2,
        "gives batch size 4 more than once",
    ),
    "bench-baseline-int8-not-measured": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--backends", "torch,ort", "--baseline", _baseline(w, _with_int8)],
        4,
        "int8: in the baseline but not measured",
    ),
    "bench-baseline-int8-not-measured-gating-speedup": Refusal(
        lambda w: [
            "bench",
            w / "art",
            *BENCH,
            "--backends",
            "torch,ort",
            "--baseline",
            _baseline(w, _with_int8),
            "--gate",
            "speedup",
        ],
        4,
        "int8: in the baseline but not measured",
    ),
    "bench-gate-unknown": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--baseline", _baseline(w), "--gate", "speedup,speed"],
        2,
        "--gate takes one or more of latency,speedup,fidelity,int8, each once; got 'speedup,speed'",
    ),
    "bench-gate-without-a-baseline": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--gate", "speedup", "--max-regression", "0.1"],
        2,
        "--gate, --max-regression apply only with --baseline",
    ),
    "bench-latency-tolerance-without-the-latency-gate": Refusal(
        lambda w: [
            "bench",
            w / "art",
            *BENCH,
            "--baseline",
            _baseline(w),
            "--gate",
            "speedup",
            "--max-latency-regression",
            "0.5",
        ],
        2,
        "--max-latency-regression is the latency gate's tolerance; it applies only when --gate names latency",
    ),
    "bench-gate-int8-on-a-baseline-without-int8": Refusal(
        lambda w: [
            "bench",
            w / "art",
            *BENCH,
            "--backends",
            "ort",
            "--baseline",
            _baseline(w),
            "--gate",
            "speedup,int8",
        ],
        1,
        "--gate int8: baseline {w}/baseline.json has no int8 numbers to compare; gate speedup only, or make a",
    ),
    "bench-plot-not-png": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--plot", w / "p.jpg"], 2, "does not end in .png"
    ),
    "bench-o-foreign-folder": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "-o", _foreign(w, "bench.json")],
        1,
        "holds no corp-deploy-record.json that corp-deploy can read",
    ),
    "bench-data-missing": Refusal(lambda w: ["bench", w / "art", *BENCH, "--data", w / "nope"], 1, "nope: not found"),
    "bench-data-is-a-file": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--data", png(w / "a.png")], 1, "a.png: not a directory"
    ),
    "bench-class-index-names-a-missing-folder": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--data", _labelled(w, {"cats": 1, "dogs": 2})],
        1,
        "names classes that have no folder",
    ),
    "bench-class-index-beyond-the-outputs": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--data", _labelled(w, {"cats": 5000})],
        1,
        "maps a class to output 5000, but the model has 1000 outputs",
    ),
    "bench-labels-for-a-backbone": Refusal(
        lambda w: ["bench", _backbone(w), *BENCH, "--backends", "torch", "--data", _labelled(w, {"cats": 1})],
        1,
        "the model has no classifier to score them against",
    ),
    "bench-class-index-malformed": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--data", _labelled(w, "{oops")], 1, "cannot read"
    ),
    "bench-batch-beyond-the-exported-range": Refusal(
        lambda w: ["bench", w / "art", *setting(BENCH, "--batch", 100000)],
        2,
        "'--batch': takes batch sizes up to 65536 (the exported graphs' batch range",
    ),
    # sweep
    "sweep-o-foreign-folder-with-sweep-json": Refusal(
        lambda w: ["sweep", *BASE[1:], "--s", 0.5, "-o", _foreign(w, "sweep.json")],
        1,
        "holds no corp-deploy-record.json that corp-deploy can read",
    ),
    "sweep-sparsity-out-of-range": Refusal(
        lambda w: ["sweep", *BASE[1:], "--s", "0.3,1.5", "-o", w / "o"], 2, "--s must be in [0, 1), got 1.5"
    ),
    "sweep-unknown-method": Refusal(
        lambda w: ["sweep", *BASE[1:], "--methods", "corp,magic", "-o", w / "o"], 2, "--methods must be distinct names"
    ),
    "sweep-repeated-point": Refusal(
        lambda w: ["sweep", *BASE[1:], "--s", "0.3,0.30000001", "-o", w / "o"],
        2,
        "--s gives the same run twice (corp-s0.3)",
    ),
    "sweep-budget-with-vbp": Refusal(
        lambda w: ["sweep", *BASE[1:], "--macs", 0.6, "--methods", "vbp", "-o", w / "o"], 2, "--macs applies to"
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refused_with_one_message_and_nothing_changed(name, work, monkeypatch):
    case = REFUSALS[name]
    if case.hide_cuda:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = case.args(work)
    before, planted = snapshot(work), debris(work)  # (a case may plant a killed run's leftovers)
    code, text, exception = invoke(args, work.parent / "state")
    assert_one_message(code, text, exception, case.code, case.message.replace("{w}", str(work)))
    assert snapshot(work) == before
    assert debris(work) == planted and not (work / "pwned").exists()


# ---------------------------------------------------------------- every option: out of range is bad usage

#: A command line of each command that is valid but for the option under test (given after it).
VALID = {
    "compress": lambda w: [*BASE, "-o", w / "o"],
    "export": lambda w: ["export", w / "art", "-o", w / "o"],
    "bench": lambda w: ["bench", w / "art", *BENCH],
    "sweep": lambda w: ["sweep", *BASE[1:], "--s", 0.5, "-o", w / "o"],
    "recover": lambda w: ["recover", w / "art", "-o", w / "o"],
}
#: Values out of range for options whose type does not say its range (a string parsed later).
OUT_OF_RANGE = {
    "--model-arg": "depth",
    "--backends": "tensorflow",
    "--methods": "magic",
    "export --batch": "8:4:2",
    "--int8-keep-float": "-1",
    "--int8-smoothing": "2",
}


def _out_of_range(command: str, param: click.Parameter) -> str | None:
    """A value of ``param`` outside its range, inferred from its type; None for a flag (no value)
    and for the MODEL argument (a name whose model may not exist: exit 1, what it names)."""
    option = param.opts[-1]
    if getattr(param, "is_flag", False) or param.name == "model":
        return None
    if f"{command} {option}" in OUT_OF_RANGE or option in OUT_OF_RANGE:
        return OUT_OF_RANGE.get(f"{command} {option}", OUT_OF_RANGE.get(option))
    kind = param.type
    if isinstance(kind, click.IntRange):
        return str(kind.max + 1 if kind.max is not None else kind.min - 1)
    if isinstance(kind, (click.FloatRange, click.types.FloatParamType)):
        return "nan"
    if isinstance(kind, click.types.IntParamType):
        return "-1"
    if isinstance(kind, click.Choice):
        return "no-such-choice"
    if isinstance(kind, click.Path):
        return ""
    return "x"  # the lists of numbers and sizes


EVERY_OPTION = [
    (command, param, value)
    for command, group in sorted(cli.commands.items())
    for param in group.params
    if (value := _out_of_range(command, param)) is not None
]


@pytest.mark.parametrize(
    "command, param, value", EVERY_OPTION, ids=[f"{c}-{p.opts[-1].lstrip('-')}" for c, p, _ in EVERY_OPTION]
)
def test_every_out_of_range_option_value_exits_2_naming_the_option(work, command, param, value):
    """One rule for every option of every command: a value out of its range (or of the wrong
    form) is bad usage, exit 2, in one message that names the option as the user typed it, before
    anything is written."""
    args = VALID[command](work)
    if isinstance(param, click.Argument):
        args[1] = value
    else:
        args = setting(args, param.opts[-1], value, aliases=tuple(param.opts))
    before = snapshot(work)
    code, text, exception = invoke(args, work.parent / "state")
    named = param.human_readable_name if isinstance(param, click.Argument) else param.opts[-1]
    assert_one_message(code, text, exception, 2, named)
    assert snapshot(work) == before and not debris(work)


# ---------------------------------------------------------------- accepted with a warning, or replaced


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


def test_the_tools_own_output_is_replaced_with_the_exports_inside_it(work):
    assert (work / "art" / "export-fp32").is_dir()
    code, text, _ = invoke([*BASE, "--seed", 3, "-o", work / "art"], work.parent / "state")
    assert code == 0, text
    assert sorted(p.name for p in (work / "art").iterdir()) == [
        "config.json",
        RECORD_FILE,
        "model.safetensors",
        "report.json",
    ]
    assert json.loads((work / "art" / "config.json").read_text())["settings"]["seed"] == 3
    assert not debris(work)


def test_a_symlinked_output_is_written_through_the_link(work):
    (work / "link").symlink_to(work / "art")
    code, text, _ = invoke([*BASE, "--seed", 3, "-o", work / "link"], work.parent / "state")
    assert code == 0, text
    assert (work / "link").is_symlink() and os.readlink(work / "link") == str(work / "art")
    assert json.loads((work / "link" / "config.json").read_text())["settings"]["seed"] == 3
    assert load_compressed(work / "link") is not None and not debris(work)


@pytest.fixture
def nobody_reads():
    """The write end of a pipe whose read end is closed already: a reader gone before the child starts,
    so that every write of the child to it fails, its first one included."""
    read, write = os.pipe()
    os.close(read)
    yield write
    os.close(write)


def test_a_closed_standard_output_after_the_artifact_is_written_says_the_artifact_is_complete(tmp_path, nobody_reads):
    """``corp-deploy compress ... | head -0``: the summary cannot be printed once the artifact is in
    place. The message says the artifact is complete and what failed, with its own exit status
    (5), never "nothing partial was left behind"; no traceback and no failing flush at exit."""
    done = subprocess.run(
        [sys.executable, "-m", "corp_deploy.launch", *BASE, "-o", str(tmp_path / "art")],
        stdout=nobody_reads,  # the reader went away before the summary
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "CORP_DEPLOY_STATE_DIR": str(tmp_path / "state")},
    )
    stderr = done.stderr
    assert done.returncode == 5, stderr
    assert f"{tmp_path / 'art'} is complete (written before the failure), but a later step failed: " in stderr
    assert "printing the results on the standard output failed (Broken pipe)" in stderr
    assert "nothing partial" not in stderr and "Traceback" not in stderr and "Exception ignored" not in stderr
    assert stderr.count("Error:") == 1, stderr
    verify_files(tmp_path / "art", "artifact")


def test_a_standard_output_closed_from_the_start_is_a_failed_print_not_a_silent_one(tmp_path):
    """``corp-deploy compress ... >&-``: Python starts with no ``sys.stdout`` and ``print`` would
    write nowhere; the run says its artifact is complete and that printing failed (exit 5), and the
    group's own --help fails with one line."""
    env = {**os.environ, "CORP_DEPLOY_STATE_DIR": str(tmp_path / "state")}
    closed = {"preexec_fn": lambda: os.close(1), "stderr": subprocess.PIPE, "text": True, "cwd": tmp_path, "env": env}
    done = subprocess.run([sys.executable, "-m", "corp_deploy.launch", *map(str, BASE), "-o", "art"], **closed)
    assert done.returncode == 5, done.stderr
    assert f"{tmp_path / 'art'} is complete (written before the failure), but a later step failed: " in done.stderr
    assert "printing the results on the standard output failed (standard output is closed)" in done.stderr
    verify_files(tmp_path / "art", "artifact")
    done = subprocess.run([sys.executable, "-m", "corp_deploy.launch", "--help"], **closed)
    assert done.returncode == 1 and done.stderr.strip() == (
        "corp-deploy: printing on the standard output failed (standard output is closed)"
    ), done.stderr


def test_a_baseline_of_other_evaluation_images_is_refused_before_any_timing(work, monkeypatch):
    """The number of built-in evaluation images is known before the run: a baseline measured on
    another number is refused before anything is timed."""
    import benchmarks.pipeline

    def timed(*args, **kwargs):
        raise AssertionError("timing started")

    monkeypatch.setattr(benchmarks.pipeline, "run_bench", timed)
    baseline = _baseline(work, lambda r: r["fidelity"].update(data={"source": "builtin", "images": 64}))
    code, text, exception = invoke(["bench", work / "art", *BENCH, "--baseline", baseline], work.parent / "state")
    assert_one_message(code, text, exception, 1, "measured fidelity on other images than this run (images 64")


def test_a_batch_that_cannot_fit_in_memory_is_refused_before_the_work(work, monkeypatch):
    """bench's timing batch and recovery's training batch are checked against the memory available
    (lower bounds: the batch, the activations a step must hold) before any image is read."""
    from corp_deploy import resources

    monkeypatch.setattr(resources, "available_bytes", lambda: 60 * 2**20)  # 60 MiB; recovery needs 100 MB
    args = ["bench", work / "art", *setting(BENCH, "--batch", 8192)]
    code, text, exception = invoke(args, work.parent / "state")
    assert_one_message(code, text, exception, 1, "timing at batch 8192 needs at least")
    args = [*BASE, "--recover-steps", 2, "--recover-batch-size", 4096, "-o", work / "o"]
    code, text, exception = invoke(args, work.parent / "state")
    assert_one_message(code, text, exception, 1, "recovering at 4096 images per step needs at least")
    assert "--recover-checkpointing" in text and not (work / "o").exists()


def test_a_budget_below_the_floors_is_refused_before_any_image_is_read(work, monkeypatch):
    """A MAC budget the model cannot meet with every unit at its floor is refused before the
    calibration images are read and embedded, every amount in one unit and as a share of the dense model."""
    import corp_deploy.engine

    def embedded(*args, **kwargs):
        raise AssertionError("calibration started")

    monkeypatch.setattr(corp_deploy.engine, "embed_all", embedded)
    code, text, exception = invoke([*BASE, "--macs", "1e-30", "-o", work / "o"], work.parent / "state")
    refusal = (
        "the budget (0 GMACs, 0 of the dense model's 0.001191 GMACs) is below what the floors allow: with "
        "every unit at its floor (10% of its dims, at least 1 dim) the model still needs 0.0003068 GMACs, 0.258 of"
    )
    assert_one_message(code, text, exception, 2, refusal)
    assert not (work / "o").exists()


def test_a_standard_error_that_cannot_be_written_does_not_stop_the_work(tmp_path, nobody_reads):
    """``compress ... 2>/dev/full`` (here: a pipe whose reader went away): progress and warnings
    that cannot be written are dropped, as for a closed standard error, and the command does its job."""
    done = subprocess.run(
        [sys.executable, "-m", "corp_deploy.launch", *map(str, BASE), "-o", "art"],
        stdout=subprocess.PIPE,
        stderr=nobody_reads,  # nobody reads the diagnostics
        text=True,
        cwd=tmp_path,
        env={**os.environ, "CORP_DEPLOY_STATE_DIR": str(tmp_path / "state")},
    )
    assert done.returncode == 0
    assert "corp-deploy compress" in done.stdout
    verify_files(tmp_path / "art", "artifact")


def test_a_failure_after_the_reports_are_written_says_they_are_complete(work, monkeypatch):
    """bench: the reports are in place when printing the table fails (a full disk behind stdout):
    exit 5, naming the reports as complete."""
    import errno

    import benchmarks.report

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(benchmarks.report, "print_terminal", full)
    args = ["bench", work / "art", *BENCH, "--backends", "torch", "--json", work / "r.json", "-o", work / "b"]
    code, text, exception = invoke(args, work.parent / "state")
    assert_one_message(code, text, exception, 5, "are complete (written before the failure), but a later step failed")
    assert "printing the results on the standard output failed (No space left on device)" in text
    assert str(work / "r.json") in text and str(work / "b") in text and "nothing partial" not in text
    verify_files(work / "b", "bench")
    assert json.loads((work / "r.json").read_text())["format"] == "corp-deploy-bench"


def test_a_failed_state_write_does_not_fail_a_run_that_succeeded(work):
    blocker = work.parent / "state-file"
    blocker.write_text("not a directory")
    result = CliRunner().invoke(
        cli, [str(a) for a in [*BASE, "-o", work / "o"]], env={"CORP_DEPLOY_STATE_DIR": str(blocker / "state")}
    )
    assert result.exit_code == 0, result.output
    assert "warning: could not record" in result.output and load_compressed(work / "o") is not None


def test_without_a_home_no_state_is_kept_and_the_commands_say_so(tmp_path, built, monkeypatch):
    """``HOME`` empty, relative or unset (and no ``XDG_STATE_HOME`` or ``CORP_DEPLOY_STATE_DIR``):
    no state folder (never ``/.local/state`` at the file system's root); compress warns that it
    keeps no record and completes, a command without an artifact says why it has none."""
    from corp_deploy.latest import state_dir

    monkeypatch.delenv("CORP_DEPLOY_STATE_DIR", raising=False)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    for home in ("", "relative/home", None):
        if home is None:
            monkeypatch.delenv("HOME")
        else:
            monkeypatch.setenv("HOME", home)
        assert state_dir() is None
    unset = {"CORP_DEPLOY_STATE_DIR": None, "XDG_STATE_HOME": None, "HOME": ""}
    result = CliRunner().invoke(cli, [str(a) for a in [*BASE, "-o", tmp_path / "art"]], env=unset)
    said = " ".join(result.output.split())
    assert result.exit_code == 0 and "keeps no record of the most recent artifact: pass" in said, result.output
    result = CliRunner().invoke(cli, ["export"], env=unset)
    assert_one_message(result.exit_code, result.output, result.exception, 1, "pass the artifact directory")
    assert "keeps no record" in result.output


def test_the_library_names_wrong_types_and_values_before_any_work(tiny_artifact):
    """The public functions check what they are given, as the CLI does, with one message naming
    the argument (never a raw TypeError, an overflow after compression, or the wrong cause): no
    calibration batches, a seed no generator takes, recovery of 0 steps, raw uint8 pixels and NaN
    (compress's message), a float16 model (its dtype, not "not the weights it was compressed from");
    bench's settings out of range and paths given as bytes."""
    import corp_deploy
    from benchmarks.gate import read_baseline
    from benchmarks.results import BenchSettings
    from corp_deploy.recovery import RecoveryConfig, recover
    from exporters import ExportOptions, export_artifact

    dense = build_small_vit()
    batches = [torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))]
    student, _ = corp_deploy.compress(dense, batches, corp_deploy.CompressConfig(sparsity=0.5))
    quick = RecoveryConfig(steps=1, batch_size=2, eval_every=1, workers=0)
    refused = {
        "calibration_batches must be an iterable of preprocessed image batches, tensors (B, 3, H, W), not NoneType": (
            lambda: corp_deploy.compress(dense, None)
        ),
        "recover_seed must be an integer from 0 to 4,294,967,295, got 18446744073709551616": (
            lambda: RecoveryConfig(steps=1, seed=2**64)
        ),
        "recover_steps must be at least 1 to recover (0 is off: nothing would train)": (
            lambda: recover(student, dense, batches, RecoveryConfig(steps=0, lr=1e-3))
        ),
        "images must be an iterable of preprocessed image batches": lambda: recover(student, dense, None, quick),
        "name must be a str, not bytes": lambda: corp_deploy.create_base_model(b"deit_tiny", pretrained=False),
        "model_kwargs must be a dict, not list": lambda: corp_deploy.create_base_model("deit_tiny", [1, 2]),
        "seed must be an integer in [0, 2**64) or None, got -1": (
            lambda: corp_deploy.create_base_model("deit_tiny", pretrained=False, seed=-1)
        ),
        "student must be a timm ViT (torch.nn.Module), not NoneType": lambda: recover(None, dense, batches, quick),
        "calibration batches must be preprocessed (normalised, floating-point) images; got torch.uint8": (
            lambda: recover(student, dense, [batches[0].clamp(0, 1).mul(255).to(torch.uint8)], quick)
        ),
        "calibration batch contains NaN or infinite values": (
            lambda: recover(student, dense, [torch.full_like(batches[0], float("nan"))], quick)
        ),
        "the compressed model's weights are float16: recovery trains float32 models": (
            lambda: recover(copy.deepcopy(student).half(), dense, batches, quick)
        ),
        "the dense model's weights are bfloat16": lambda: recover(
            student, copy.deepcopy(dense).bfloat16(), batches, quick
        ),
        "batches takes one or more batch sizes from 1 to 65,536, each once; got tuple (0,)": (
            lambda: BenchSettings(batches=(0,))
        ),
        "min_time must be a finite number of seconds > 0, got nan": lambda: BenchSettings(min_time=math.nan),
        "out_dir must be a str or a pathlib.Path, not bytes": (
            lambda: export_artifact(tiny_artifact, b"export", ExportOptions())
        ),
        "baseline must be a str or a pathlib.Path, not bytes": lambda: read_baseline(b"main.json"),
    }
    for message, call in refused.items():
        with pytest.raises(corp_deploy.CorpError) as raised:
            call()
        assert message in str(raised.value), (message, str(raised.value))


def test_a_path_that_is_not_utf8_is_refused_before_any_work(work, monkeypatch):
    """A default output in a folder whose name is not valid UTF-8 (relative to such a current
    directory) and the library's paths alike: refused before anything is built or written, not
    written as an artifact that no command can read back; an unreadable image of such a name inside
    ``--calib`` is named with the byte written out (every record stays valid UTF-8)."""
    from corp_deploy import CalibrationSpec, CompressConfig, compress_to_artifact
    from corp_deploy.errors import BadUsage

    folder = work / NOT_UTF8
    folder.mkdir()
    monkeypatch.chdir(folder)
    code, text, exception = invoke(BASE, work.parent / "state")
    assert_one_message(code, text, exception, 2, f"{work}/caf\\xff/corp-deploy/deit_tiny-s0.5 is not valid UTF-8")
    assert "building" not in text and list(folder.iterdir()) == []
    for call in (
        lambda: compress_to_artifact(build_small_vit(), CompressConfig(), CalibrationSpec(samples=4), "out"),
        lambda: load_compressed(work / NOT_UTF8),
        lambda: CalibrationSpec(work / NOT_UTF8),
    ):
        with pytest.raises(BadUsage, match=r"caf\\xff(/out)? is not valid UTF-8"):
            call()
    calib = image_folder(work / "calib", count=2)
    (calib / f"{NOT_UTF8}.png").write_bytes(b"not a picture")
    code, text, _ = invoke([*BASE, "--calib", calib, "-o", work / "calibrated"], work.parent / "state")
    assert code == 0 and "caf\\xff.png: not an image" in text, text
    assert "\\udc" not in (work / "calibrated" / "config.json").read_text()


def test_a_gate_on_unmeasured_fidelity_of_a_backbone_fails(work):
    code, text, _ = invoke([*BASE, "--model-arg", "num_classes=0", "-o", work / "backbone"], work.parent / "state")
    assert code == 0, text
    code, text, _ = invoke(
        ["bench", work / "backbone", *BENCH, "--backends", "torch", "--min-agreement", 0.9], work.parent / "state"
    )
    assert code == 4 and "--min-agreement was given but top-1 agreement was not measured" in text, text


@pytest.mark.parametrize("budget", [["--macs", 1], ["--speedup", 1]])
def test_a_budget_of_the_whole_model_answers_at_once(work, monkeypatch, budget):
    """``--macs 1`` / ``--speedup 1``: every unit keeps all its dims, and no error curve is measured
    (the budget pass, the longer half of a budget run, is skipped)."""
    import corp_deploy.methods.corp.budget as budget_module

    def never(*args, **kwargs):
        raise AssertionError("the error curves were measured")

    monkeypatch.setattr(budget_module, "measure_curves", never)
    code, text, _ = invoke([*BASE, *budget, "-o", work / "o"], work.parent / "state")
    assert code == 0, text
    report = json.loads((work / "o" / "report.json").read_text())
    assert report["macs"]["compressed"] == report["macs"]["dense"]
    assert all(unit["kept"] == unit["total"] for unit in report["budget"]["units"])


def test_bench_replaces_its_own_report_folder_and_json(work):
    for _ in range(2):
        code, text, _ = invoke(
            ["bench", work / "art", *BENCH, "--backends", "torch", "-o", work / "b", "--json", work / "r.json"],
            work.parent / "state",
        )
        assert code == 0, text
    assert sorted(p.name for p in (work / "b").iterdir()) == ["bench.md", "bench.png", RECORD_FILE]
    verify_files(work / "b", "bench")
    assert json.loads((work / "r.json").read_text())["format"] == "corp-deploy-bench" and not debris(work)


def test_an_old_output_that_cannot_be_removed_completely_is_left_with_a_warning(work, monkeypatch):
    """The new output is in place; what the file system refuses to delete stays, named, and the run
    succeeds (before: an error after the swap, exit 1)."""
    original = Path.unlink

    def refuse(self, *args, **kwargs):
        if self.name == "dense.onnx" and ".art.old-" in str(self):
            raise PermissionError(1, "Operation not permitted")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", refuse)
    with pytest.warns(UserWarning, match="the old one could not be removed completely") as warned:
        code, text, _ = invoke([*BASE, "--seed", 3, "-o", work / "art"], work.parent / "state")
    assert code == 0, text
    assert len(warned) == 1 and "export-fp32/dense.onnx: Operation not permitted" in str(warned[0].message)
    assert json.loads((work / "art" / "config.json").read_text())["settings"]["seed"] == 3
    left = [p.name for p in work.iterdir() if p.name.startswith(".art.old-")]
    assert len(left) == 1 and [p.name for p in (work / left[0]).rglob("*")] == ["export-fp32", "dense.onnx"]


def test_a_file_of_the_old_output_changed_after_the_check_is_kept(work, monkeypatch):
    """Removing the old output deletes a file only if it still has its recorded content: one another
    program rewrote between the check and the removal stays, named in the warning."""
    import corp_deploy.outputs as outputs

    original = outputs._remove_output

    def rewrite_then_remove(folder):
        (folder / "config.json").write_text("edited by someone else")
        return original(folder)

    monkeypatch.setattr(outputs, "_remove_output", rewrite_then_remove)
    with pytest.warns(UserWarning, match="config.json: changed since it was checked"):
        code, text, _ = invoke([*BASE, "--seed", 5, "-o", work / "art"], work.parent / "state")
    assert code == 0, text
    (left,) = [p for p in work.iterdir() if p.name.startswith(".art.old-")]
    assert (left / "config.json").read_text() == "edited by someone else"
    assert json.loads((work / "art" / "config.json").read_text())["settings"]["seed"] == 5


def test_the_old_record_rewritten_after_it_was_read_is_kept(work, monkeypatch):
    """The old output's record is deleted only while it is still the one read at the start of the
    removal: one another program rewrote meanwhile stays, named in the warning."""
    import corp_deploy.outputs as outputs

    original = outputs.read_record

    def read_then_rewrite(folder):
        record = original(folder)
        path = Path(folder) / outputs.RECORD_FILE
        if ".art.old-" in str(folder) and record is not None and "rewritten" not in record:
            path.write_text(json.dumps({**record, "rewritten": True}))
        return record

    monkeypatch.setattr(outputs, "read_record", read_then_rewrite)
    with pytest.warns(UserWarning, match="corp-deploy-record.json: changed since it was checked"):
        code, text, _ = invoke([*BASE, "--seed", 5, "-o", work / "art"], work.parent / "state")
    assert code == 0, text
    (left,) = [p for p in work.iterdir() if p.name.startswith(".art.old-")]
    assert json.loads((left / outputs.RECORD_FILE).read_text())["rewritten"] is True


def test_a_failure_after_the_swap_keeps_the_new_output(tmp_path):
    """Once the staged output is in place its name is the destination's: an error raised afterwards
    (here the leftover warning turned into an error) removes nothing."""
    with staged_output(tmp_path / "out", "sweep") as staging:
        (staging / "a.txt").write_text("old")
    original = Path.unlink

    def refuse(self, *args, **kwargs):
        if self.name == "a.txt" and ".out.old-" in str(self):
            raise PermissionError(1, "Operation not permitted")
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        patch.setattr(Path, "unlink", refuse)
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="could not be removed completely"):
            with staged_output(tmp_path / "out", "sweep") as staging:
                (staging / "a.txt").write_text("new")
    assert (tmp_path / "out" / "a.txt").read_text() == "new"
    verify_files(tmp_path / "out", "sweep")


def test_an_export_refuses_an_artifact_replaced_while_it_was_exported(work, monkeypatch):
    """The manifest would otherwise name the new artifact while holding the old model's graph."""
    import exporters.pipeline as pipeline

    original = pipeline.export_onnx

    def replace_artifact_then_export(*args, **kwargs):
        code, text, _ = invoke([*BASE, "--seed", 4, "-o", work / "art"], work.parent / "state")
        assert code == 0, text
        return original(*args, **kwargs)

    monkeypatch.setattr(pipeline, "export_onnx", replace_artifact_then_export)
    code, text, exception = invoke(["export", work / "art", "-o", work / "exp"], work.parent / "state")
    assert_one_message(code, text, exception, 1, "was replaced while it was exported; nothing was written")
    assert not (work / "exp").exists() and not debris(work)


def test_an_export_refuses_a_dense_model_that_is_not_the_artifacts_base(work):
    """dense.onnx is the unpruned base of model.onnx: another model (other classes, other weights) is
    refused before anything is written, not found later as a parity failure or a bug."""
    from exporters import ExportOptions, export_artifact

    for other, message in (
        (build_small_vit(seed=0, num_classes=7), "the dense model has 7 classes and the compressed one 1000"),
        (build_small_vit(seed=1), "patch embedding differs from the compressed model's"),
    ):
        with pytest.raises(CorpError, match=message):
            export_artifact(work / "art", work / "x", ExportOptions(dense=True), dense_model=other)
        assert not (work / "x").exists() and not debris(work)


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


def test_a_bench_refuses_an_artifact_replaced_while_it_was_benchmarked(work, monkeypatch):
    """Its numbers would be of a model no longer there; a report that is written names what it measured."""
    import benchmarks.pipeline as pipeline

    original = pipeline.run_bench

    def replace_artifact_then_bench(*args, **kwargs):
        code, text, _ = invoke([*BASE, "--seed", 4, "-o", work / "art"], work.parent / "state")
        assert code == 0, text
        return original(*args, **kwargs)

    before = recorded_checksums(work / "art")
    code, text, _ = invoke(["bench", work / "art", *BENCH, "--json", work / "kept.json"], work.parent / "state")
    assert code == 0 and json.loads((work / "kept.json").read_text())["artifact"] == before, text
    monkeypatch.setattr(pipeline, "run_bench", replace_artifact_then_bench)
    code, text, exception = invoke(["bench", work / "art", *BENCH, "--json", work / "r.json"], work.parent / "state")
    assert_one_message(code, text, exception, 1, "was replaced while it was benchmarked")
    assert not (work / "r.json").exists() and not debris(work)


def test_a_run_that_cannot_fit_in_memory_is_refused_before_the_work(work, monkeypatch):
    monkeypatch.setattr("corp_deploy.resources.available_bytes", lambda: 1024)  # a machine with 1 KiB free
    three = image_folder(work.parent / "three", 3)
    for args, what in (
        ([*BASE, "-o", work / "o"], "compressing deit_tiny_patch16_224 on 4 images"),
        (  # the files alone: at most 10**7 asked for, the 3 there are counted
            [*BASE[:-2], "--calib", three, "--calib-samples", 10**7, "--no-calib-crops", "-o", work / "o"],
            "compressing deit_tiny_patch16_224 on 3 images",
        ),
        (  # filled with crops of the 3: every image asked for is counted
            [*BASE[:-2], "--calib", three, "--calib-samples", 10**7, "-o", work / "o"],
            "compressing deit_tiny_patch16_224 on 10000000 images",
        ),
        (["export", work / "art", "-o", work / "o"], "the export"),
        (["bench", work / "art", *BENCH], "timing at batch 1"),
    ):
        before = snapshot(work)
        code, text, exception = invoke(args, work.parent / "state")
        assert_one_message(code, text, exception, 1, f"{what} needs at least")
        assert "GiB are available" in text and snapshot(work) == before


def test_running_out_of_memory_or_disk_is_one_message_not_a_bug_report(work, monkeypatch):
    import errno

    import safetensors.torch

    failures = {
        "memory": RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 123 bytes"
        ),
        "disk": OSError(errno.ENOSPC, "No space left on device", "model.safetensors"),
    }
    for kind, failure in failures.items():

        def fail(*args, **kwargs):
            raise failure

        monkeypatch.setattr(safetensors.torch, "save_file", fail)
        before = snapshot(work)
        code, text, exception = invoke([*BASE, "-o", work / "o"], work.parent / "state")
        message = "ran out of memory" if kind == "memory" else "the file system refused: No space left on device"
        assert_one_message(code, text, exception, 1, message)
        assert "bug" not in text and snapshot(work) == before and not debris(work)


def _exporter_error_from_a_full_disk() -> Exception:
    import errno

    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as cause:
        try:
            raise torch.onnx.OnnxExporterError("Failed to export the model to ONNX") from cause
        except torch.onnx.OnnxExporterError as error:
            return error


#: How libraries report a full disk in their own exception types: the failure, and the command
#: whose write raises it (compress saving the weights, export the graph).
LIBRARY_DISK_FAILURES = {
    "safetensors": (
        lambda: __import__("safetensors").SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        ),
        "compress",
    ),
    "torch-stream-writer": (
        lambda: RuntimeError(
            "[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file data/0: "
            "file write failed"
        ),
        "compress",
    ),
    "onnx-exporter-raised-from-the-os-error": (_exporter_error_from_a_full_disk, "export"),
}


@pytest.mark.parametrize("library", sorted(LIBRARY_DISK_FAILURES))
def test_a_full_disk_inside_a_library_is_one_plain_message(work, monkeypatch, library):
    """A full disk reported by a library in its own exception type is the file system's refusal,
    never "internal error ... a bug"; nothing is left."""
    import safetensors.torch

    import exporters.pipeline

    failure, command = LIBRARY_DISK_FAILURES[library]

    def fail(*args, **kwargs):
        raise failure()

    if command == "compress":
        monkeypatch.setattr(safetensors.torch, "save_file", fail)
        args = [*BASE, "-o", work / "o"]
    else:
        monkeypatch.setattr(exporters.pipeline, "export_onnx", fail)
        args = ["export", work / "art", "-o", work / "o"]
    before = snapshot(work)
    code, text, exception = invoke(args, work.parent / "state")
    assert_one_message(code, text, exception, 1, "the file system refused: ")
    assert ("No space left on device" in text or "the disk may be full" in text) and "bug" not in text, text
    assert snapshot(work) == before and not debris(work)


def test_the_disk_check_counts_the_old_output_that_stays_until_the_swap(work, monkeypatch):
    """Replacing an artifact: the old one keeps its room until the new one is complete, so the free
    space must hold the whole new artifact; refused before anything is written, naming both."""
    import shutil as shell

    real = shell.disk_usage
    weights = (work / "art" / "model.safetensors").stat().st_size
    monkeypatch.setattr(shell, "disk_usage", lambda path: real(path)._replace(free=weights // 2))
    before = snapshot(work)
    code, text, exception = invoke([*BASE, "-o", work / "art"], work.parent / "state")
    assert_one_message(code, text, exception, 1, "of disk in")
    assert "both need room at once" in text and snapshot(work) == before and not debris(work)


def test_a_library_artifact_of_a_model_corp_deploy_did_not_build_can_record_its_dense_weights(tmp_path):
    """An artifact written by compress_to_artifact from the caller's own model records its dense
    weights only when told (base_model's "weights"): without a record, export --dense is refused
    with a message that names the record's forms; with one (a checkpoint), it exports the dense graph."""
    import timm
    from safetensors.torch import save_file

    from corp_deploy import CalibrationSpec, CompressConfig, compress_to_artifact
    from tests.helpers import SMALL_VIT_KWARGS

    torch.manual_seed(5)
    own = timm.create_model("deit_tiny_patch16_224", pretrained=False, **SMALL_VIT_KWARGS).eval()
    spec, config = CalibrationSpec(samples=4, batch_size=4), CompressConfig(s_mlp=0.5)
    base = {"name": "deit_tiny_patch16_224", "model_kwargs": SMALL_VIT_KWARGS}
    compress_to_artifact(own, config, spec, tmp_path / "unrecorded", base_model=base)
    code, text, _ = invoke(["export", tmp_path / "unrecorded", "--dense"], tmp_path / "state")
    assert code == 1 and "does not record where its dense weights came from" in text, text
    forms = "'weights': ...}, the weights {'source': 'checkpoint', 'path': FILE}"
    assert forms in " ".join(text.split()) and "Traceback" not in text
    assert not (tmp_path / "unrecorded" / "export-fp32").exists()

    save_file(own.state_dict(), str(tmp_path / "own.safetensors"))
    weights = {"source": "checkpoint", "path": str(tmp_path / "own.safetensors")}
    compress_to_artifact(own, config, spec, tmp_path / "recorded", base_model={**base, "weights": weights})
    code, text, _ = invoke(["export", tmp_path / "recorded", "--dense"], tmp_path / "state")
    assert code == 0, text
    assert (tmp_path / "recorded" / "export-fp32" / "dense.onnx").is_file()


def test_an_artifact_that_does_not_record_its_settings_is_not_recovered_or_exported_against_a_non_vit(
    tiny_artifact, tmp_path
):
    """recover compresses the dense model again with the artifact's recorded settings: an artifact
    saved without them (save_artifact's settings left out) is refused, not compressed again with the
    defaults. A weights record naming other weights is refused by bench (as by every reader of the
    dense model). export_artifact's dense_model that is no ViT is named as such."""
    from corp_deploy import compress, create_base_model, save_artifact
    from exporters.options import ExportOptions
    from exporters.pipeline import export_artifact
    from tests.helpers import SMALL_VIT_KWARGS

    dense = create_base_model("deit_tiny", SMALL_VIT_KWARGS, pretrained=False, seed=0)
    model, report = compress(dense, [torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))])
    base = {
        "name": "deit_tiny_patch16_224",
        "model_kwargs": SMALL_VIT_KWARGS,
        "weights": {"source": "random", "seed": 0},
    }
    save_artifact(model, tmp_path / "art", base_model=base, report=report)
    code, text, _ = invoke(["recover", tmp_path / "art", "-o", tmp_path / "rec"], tmp_path / "state")
    assert code == 1 and "does not record the settings it was compressed with (method, calib_samples" in text, text
    assert not (tmp_path / "rec").exists()
    lying = {**base, "weights": {"source": "random", "seed": 7}}  # the model was built from seed 0
    save_artifact(model, tmp_path / "lying", base_model=lying, report=report)
    code, text, _ = invoke(["bench", tmp_path / "lying", *BENCH, "--backends", "torch"], tmp_path / "state")
    assert code == 1 and "is not the one it was compressed from (patch_embed.proj." in text, text
    with pytest.raises(CorpError, match=r"the dense model \(Identity\) is not a timm ViT"):
        export_artifact(tiny_artifact, tmp_path / "o", ExportOptions(dense=True), dense_model=torch.nn.Identity())
    assert not (tmp_path / "o").exists()


def test_the_library_names_wrong_types_as_wrong_types(tiny_artifact, tmp_path):
    """A library caller's value of the wrong type is named as such (not as out of range, and never
    a TypeError from deep inside), and so is a dict given where a config class is expected."""
    from benchmarks.gate import GateLimits
    from corp_deploy import (
        CalibrationSpec,
        CompressConfig,
        compress,
        compress_to_artifact,
        count_macs,
        load_compressed,
        model_transform,
        save_artifact,
    )
    from corp_deploy.errors import BadUsage, SettingError
    from corp_deploy.methods import CorpOptions
    from corp_deploy.recovery import RecoveryConfig, recover
    from corp_deploy.workflow import recover_artifact
    from exporters.options import ExportOptions
    from exporters.parity import Tolerance
    from exporters.pipeline import export_artifact

    model = build_small_vit()
    cases = [
        (lambda: CompressConfig(s_mlp="0.5"), "s_mlp must be a number, got str '0.5'"),
        (lambda: CompressConfig(round_to=2.0), "round_to must be an integer, got 2.0"),
        (lambda: CompressConfig(compensation="no"), "compensation must be true or false, got str 'no'"),
        (lambda: CompressConfig(method=None), "method must be a string, got None"),
        (lambda: CompressConfig(options=CorpOptions(ridge="1e-3")), "ridge must be a number, got str '1e-3'"),
        (lambda: CalibrationSpec(samples=4.0), "samples must be an integer, got 4.0"),
        (lambda: RecoveryConfig(steps="100"), "recover_steps must be an integer, got str '100'"),
        (lambda: ExportOptions(opset="18"), "opset must be an integer, got str '18'"),
        (lambda: Tolerance(atol=[1e-4]), "atol must be a number, got list [0.0001]"),
        (lambda: GateLimits(max_regression="0.1"), "max_regression must be a number, got str '0.1'"),
        (lambda: GateLimits(gates="speedup"), "gates takes one or more of latency,speedup,fidelity,int8, each once"),
        (lambda: compress(model, [], {"s_mlp": 0.5}), "config must be a CompressConfig, not dict"),
        (
            lambda: compress_to_artifact(model, CompressConfig(), {"samples": 4}, tmp_path / "o"),
            "calibration must be a CalibrationSpec, not dict",
        ),
        (
            lambda: recover_artifact(tiny_artifact, {"steps": 10}, tmp_path / "o"),
            "recovery must be a RecoveryConfig, not dict",
        ),
        (lambda: recover(model, model, [], {"steps": 2}), "config must be a RecoveryConfig, not dict"),
        (
            lambda: compress_to_artifact("deit_tiny_patch16_224", CompressConfig(), CalibrationSpec(), tmp_path / "o"),
            "dense must be a Module, not str",
        ),
        (
            lambda: export_artifact(tiny_artifact, tmp_path / "o", {"dense": True}),
            "options must be an ExportOptions, not dict",
        ),
        (
            lambda: export_artifact(tiny_artifact, tmp_path / "o", ExportOptions(), dense_model=model),
            "dense_model is exported only with ExportOptions(dense=True)",
        ),
        (lambda: count_macs("deit_tiny_patch16_224", (3, 32, 32)), "model must be a Module, not str"),
        (lambda: count_macs(model, (3, 64, 64)), "the model cannot run on one image of input_size (3, 64, 64)"),
        (lambda: model_transform(torch.nn.Linear(2, 2)), "model_transform takes a timm model"),
        (
            lambda: compress_to_artifact(
                model, CompressConfig(), CalibrationSpec(), tmp_path / "o", base_model={"name": "x", "kwargs": {}}
            ),
            "base_model is a dict of 'name' (the timm model's), 'model_kwargs' (a dict) and 'weights'; got the unknown "
            "key",
        ),
        (
            lambda: save_artifact(model, tmp_path / "o", base_model={"weights": {"source": "random", "seed": 0}}),
            "base_model is a dict of 'name' (the timm model's), 'model_kwargs' (a dict) and 'weights'",
        ),
        (
            lambda: save_artifact(model, tmp_path / "o", base_model={"name": "deit_tiny", "weights": {"seed": 1}}),
            "base_model's 'weights' is {'source': 'checkpoint', 'path': FILE}, {'source': 'random', 'seed': N}",
        ),
        (lambda: save_artifact(model, tmp_path / "o", settings="s=0.5"), "settings must be a dict, not str"),
        (lambda: load_compressed(None), "path must be a str or a pathlib.Path, not NoneType"),
        (lambda: load_compressed(bytes(tiny_artifact)), "path must be a str or a pathlib.Path, not bytes"),
    ]
    for make, message in cases:
        with pytest.raises(BadUsage) as raised:
            make()
        assert str(raised.value).startswith(message), (message, str(raised.value))
        assert raised.value.exit_code == 2
        if isinstance(raised.value, SettingError):
            assert raised.value.settings  # the CLI names them as options
    assert not (tmp_path / "o").exists()
    numpy_numbers = CompressConfig(sparsity=np.float32(0.5), round_to=np.int64(2))  # numbers, as Python's
    assert (numpy_numbers.sparsity, numpy_numbers.round_to) == (0.5, 2) and type(numpy_numbers.round_to) is int


def test_a_checkpoint_is_read_by_its_content_and_pickled_objects_are_refused_plainly(tmp_path):
    """A safetensors file named ``.bin`` loads; a torch file holding a Python object is refused
    with corp-deploy's reason, not torch's advice to unpickle it."""
    import argparse

    from safetensors.torch import save_file

    from corp_deploy.errors import CorpError
    from corp_deploy.models import load_checkpoint

    model, target = build_small_vit(), build_small_vit()
    torch.nn.init.constant_(target.head.weight, 0.5)
    save_file(target.state_dict(), str(tmp_path / "weights.bin"))
    load_checkpoint(model, tmp_path / "weights.bin")
    assert torch.equal(model.head.weight, target.head.weight)
    torch.save({"state_dict": target.state_dict(), "args": argparse.Namespace(lr=1)}, tmp_path / "pickled.pth")
    with pytest.raises(CorpError) as raised:
        load_checkpoint(model, tmp_path / "pickled.pth")
    assert "holds Python objects other than tensors, and corp-deploy never unpickles those" in str(raised.value)
    assert "weights_only set to False" not in str(raised.value)


def test_calibration_batches_the_model_cannot_take_are_named_as_such():
    """Raw 8-bit images, another channel count or another image size: one CorpError naming the
    batches, not a RuntimeError or AssertionError from inside the model."""
    from corp_deploy import CompressConfig, compress
    from corp_deploy.errors import CorpError

    model, generator = build_small_vit(), torch.Generator().manual_seed(0)
    cases = [
        (torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=generator), "got torch.uint8"),
        (torch.randn(2, 1, 32, 32, generator=generator), "cannot take calibration images of shape (1, 32, 32)"),
        (torch.randn(2, 3, 64, 64, generator=generator), "cannot take calibration images of shape (3, 64, 64)"),
    ]
    for batch, message in cases:
        with pytest.raises(CorpError) as raised:
            compress(model, [batch], CompressConfig(sparsity=0.5))
        assert message in str(raised.value), str(raised.value)


def test_a_dependency_missing_from_the_installation_is_named_not_reported_as_a_bug(work, monkeypatch):
    # Seen on a GPU machine whose Polygraphy wheel went to another interpreter: export and bench
    # ended with "internal error ... this is a bug in corp-deploy".
    monkeypatch.setitem(sys.modules, "polygraphy", None)  # `import polygraphy` now raises ModuleNotFoundError
    before = snapshot(work)
    code, text, exception = invoke(["export", work / "art", "-o", work / "o"], work.parent / "state")
    assert_one_message(code, text, exception, 1, "the Python module 'polygraphy' is not installed")
    assert "bug" not in text and snapshot(work) == before and not debris(work)


def test_the_files_of_an_output_inside_an_image_folder_are_not_images_of_it(work):
    """A bench report copied into the calibration folder: its plot is no photo (the folder holds a record)."""
    from corp_deploy.calibration import find_images

    image_folder(work.parent / "cal", 3)
    with staged_output(work.parent / "cal" / "report", "bench") as folder:
        png(folder / "bench.png")
    assert [p.name for p in find_images(work.parent / "cal")] == ["0.png", "1.png", "2.png"]


def test_hidden_folders_that_the_class_index_does_not_name_are_not_classes(work):
    data = _labelled(work, {"cats": 1})
    image_folder(data / ".ipynb_checkpoints", 1)
    code, text, _ = invoke(
        ["bench", work / "art", *BENCH, "--backends", "torch", "--data", data, "--json", work / "r.json"],
        work.parent / "state",
    )
    assert code == 0, text
    assert json.loads((work / "r.json").read_text())["fidelity"]["data"]["classes"] == 1


#: A busy neighbour: a process that spins for as long as it is told to, once per line it reads.
@contextlib.contextmanager
def timed_as_if_shared(slowdown: float):
    """bench's interleaved timing at fixed costs, dense 2 ms and compressed 1 ms a call, each ``slowdown``
    times longer (a busy neighbour taking three quarters of the core: 4); every model still runs once
    per figure. No clock is read, so a machine that is itself busy running the test changes nothing
    (that interleaving cancels a neighbour's slowdown is test_bench's fake-clock test)."""
    import benchmarks.harness

    def at_fixed_costs(runs, *, min_rounds, **settings):
        for run in runs.values():
            run()
        return {key: [{"dense": 2e-3, "compressed": 1e-3}[key] * slowdown] * min_rounds for key in runs}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(benchmarks.harness, "interleaved", at_fixed_costs)
        yield


def test_a_busy_neighbour_fails_the_latency_gate_not_the_speedup_gate(work):
    """Issue 45: bench run twice against its own baseline on a shared runner failed at +75 %
    latency. With a neighbour taking three quarters of the core in the second run, its latency
    quadruples: the latency gate reports it, the speedup (timed interleaved, so slowed alike) and
    fidelity gates pass."""
    state = work.parent / "state"
    bench = ["bench", work / "art", *BENCH, "--backends", "torch", "--threads", "1"]
    with timed_as_if_shared(slowdown=1):
        code, text, _ = invoke([*bench, "--json", work / "base.json"], state)
    assert code == 0, text
    with timed_as_if_shared(slowdown=4):
        shared = ["--baseline", work / "base.json", "--max-regression", "0.25"]
        code, text, exception = invoke(
            [*bench, *shared, "--gate", "speedup,fidelity", "--json", work / "s.json"], state
        )
        passed = f"regression gate passed against {work / 'base.json'} (compared: speedup,fidelity)"
        assert code == 0 and passed in " ".join(text.split()) and "FAILED" not in text, text
        code, text, exception = invoke([*bench, *shared, "--json", work / "d.json"], state)
    assert_one_message(code, text, exception, 4, "regression gate FAILED")
    violations = text.split("regression gate FAILED:")[1].strip().splitlines()
    assert {line.split(":")[0] for line in violations} == {"latency"}, text  # not speedup, not fidelity
    assert re.match(r"latency: torch-cpu, batch 1: compressed p50 .* \(\+300\.0% > 25%\)$", violations[0]), text
    base, shared_run = (json.loads((work / name).read_text()) for name in ("base.json", "s.json"))
    assert shared_run["latency"][0]["speedup"]["median"] == base["latency"][0]["speedup"]["median"] == 2
    assert shared_run["gate"]["limits"]["gates"] == ["speedup", "fidelity"]


def test_a_baseline_int8_regression_fails_the_gate():
    from benchmarks.gate import GateLimits, regressions
    from benchmarks.results import BenchReport

    def typed(report: dict) -> BenchReport:  # the report as bench reads it: its format's name, then its entries
        return BenchReport.from_dict({"format": "corp-deploy-bench", **report})

    row = {"backend": "ort-cpu", "batch": 1, "compressed": {"p50_s": 0.01}, "speedup": {"median": 1.5}}
    report = {"latency": [row], "backends": {"ort-cpu": {"status": "ran"}}, "parity": {}, "fidelity": {}}
    baseline = {"latency": [row], "fidelity": {}}
    _with_int8(report)
    _with_int8(baseline)
    assert regressions(typed(report), GateLimits(), typed(baseline)) == []
    report["int8"]["latency"][0]["speedup_over_dense_fp32"]["compressed-int8"]["median"] = 1.5
    report["int8"]["fidelity"]["compressed-int8"]["cosine_mean"] = 0.9
    assert regressions(typed(report), GateLimits(max_regression=0.05), typed(baseline)) == [
        "int8: batch 1: compressed-int8 1.500x over dense fp32 vs baseline 2.000x",
        "int8: compressed-int8 cosine to dense fp32 0.9000 vs baseline 0.9900",
    ]
    report["int8"] = {"skipped": "no export-int8/"}
    assert regressions(typed(report), GateLimits(), typed(baseline)) == [
        "int8: in the baseline but not measured (no export-int8/)"
    ]


def test_reports_write_null_for_nan_never_bare_nan(tmp_path):
    from benchmarks.report import write_outputs
    from benchmarks.results import BenchReport

    row = {"backend": "ort-cpu", "batch": 1, "compressed": {"p50_s": 0.01}, "speedup": {"median": 1.0, "p10": 1.5}}
    report = BenchReport.from_dict({"format": "corp-deploy-bench", "fidelity": {}, "latency": [row]})
    report.fidelity.kl_mean, report.fidelity.feature_cosine = float("nan"), math.inf
    report.latency[0].speedup.median = -math.inf
    expected = report.to_dict()
    expected["fidelity"].update(kl_mean=None, feature_cosine=None)
    expected["latency"][0]["speedup"].update(median=None, p10=1.5)
    write_outputs(report, {"json": tmp_path / "r.json"})  # what bench --json writes
    write_json(tmp_path / "state.json", {"a": float("nan")})  # every other JSON the tool writes
    text = (tmp_path / "r.json").read_text() + (tmp_path / "state.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    written = json.loads((tmp_path / "r.json").read_text())
    assert len(written.pop("sha256_of_the_report_above")) == 64  # the digest that guards against edits
    assert written == expected


def test_the_build_script_quotes_a_timing_cache_path_with_a_newline(work):
    cache = work / "cache\ntouch INJECTED\n#"
    code, text, _ = invoke(
        ["export", work / "art", "--trt", "--timing-cache", cache, "-o", work / "trt"], work.parent / "state"
    )
    assert code in (0, 3), text
    done = subprocess.run(
        ["bash", str(work / "trt" / "build_engine.sh")],
        capture_output=True,
        text=True,
        cwd=work,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 127 and "trtexec not found" in done.stderr  # it ran up to the missing trtexec
    assert not list(work.rglob("INJECTED")) and not list((work / "trt").glob("INJECTED"))


def test_the_build_script_refuses_a_changed_graph(work):
    code, text, _ = invoke(["export", work / "art", "--trt", "-o", work / "trt"], work.parent / "state")
    assert code in (0, 3), text
    flip_byte(work / "trt" / "model.onnx")
    done = subprocess.run(
        ["bash", str(work / "trt" / "build_engine.sh")], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}
    )
    assert done.returncode == 1 and "model.onnx does not match the SHA-256" in done.stderr


def _pasted(line: str, cwd: Path) -> list[str]:
    """The words bash makes of ``line`` (a printed command) when it is pasted: each word printed
    by ``printf`` instead of run, so that nothing in it can run."""
    done = subprocess.run(
        ["bash", "-c", f"words() {{ printf '%s\\0' \"$@\"; }}; words {line}"],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\0")[:-1]


@pytest.mark.skipif(
    trt_backend.unavailable_reason() is None,
    reason="TensorRT and a GPU are present: no follow-up commands are printed",
)
def test_the_printed_follow_up_commands_are_safe_to_paste(work):
    """``export --trt`` without TensorRT prints the commands to run on the target machine: paths
    with a space, quotes and ``$(...)`` stay one word each and run nothing when pasted."""
    hostile = work / "it's a $(touch INJECTED) `touch INJECTED2`"
    shutil.copytree(work / "art", hostile / "art")
    code, text, _ = invoke(["export", hostile / "art", "--trt", "-o", hostile / "out"], work.parent / "state")
    assert code == 3, text
    export_line = next(line.strip() for line in text.splitlines() if "&& corp-deploy export" in line)
    script_line = next(line.strip() for line in text.splitlines() if line.strip().startswith("bash "))
    command = export_line.split(" && ", 1)[1]
    assert _pasted(command, work) == [
        "corp-deploy", "export", str(hostile / "art"), "--trt", "-o", str(hostile / "out")
    ]  # fmt: skip
    assert _pasted(script_line, work) == ["bash", str(hostile / "out" / "build_engine.sh")]
    assert not list(work.rglob("INJECTED*"))


# ---------------------------------------------------------------- concurrency


def _write_state(args) -> int:
    path, writer = args
    for i in range(25):
        write_json(path, {"writer": writer, "i": i})
    return writer


def _stage_output(args) -> int:
    dest, writer = args
    for i in range(5):
        with staged_output(dest, "bench") as tmp:
            (tmp / "bench.json").write_text(json.dumps({"writer": writer, "i": i}))
    return writer


def test_concurrent_state_writers_all_succeed_and_leave_no_temporary_files(tmp_path):
    context = multiprocessing.get_context("fork")
    with context.Pool(8) as pool:
        done = pool.map(_write_state, [(tmp_path / "latest.json", w) for w in range(32)])
    assert sorted(done) == list(range(32))  # no writer failed (800 writes)
    assert json.loads((tmp_path / "latest.json").read_text())["i"] == 24
    assert [p.name for p in tmp_path.iterdir()] == ["latest.json"]


def test_concurrent_writers_of_one_output_all_succeed_and_leave_one_whole_output_and_no_siblings(tmp_path):
    context = multiprocessing.get_context("fork")
    with context.Pool(4) as pool:
        assert sorted(pool.map(_stage_output, [(tmp_path / "out", w) for w in range(4)])) == [0, 1, 2, 3]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    verify_files(tmp_path / "out", "bench")
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["i"] == 4


# ---------------------------------------------------------------- faults: interrupted runs

FAULT_RUNNER = """
import os, signal, sys, importlib
module = importlib.import_module(sys.argv[1])
name, call = sys.argv[2], int(sys.argv[3])
base, _, offset = sys.argv[4].partition("+")  # SIGTERM, or a real-time signal: SIGRTMIN+2
signum = getattr(signal, base) + int(offset or 0)
signal.signal(signum, signal.SIG_DFL)  # as in a shell's foreground job, whatever this test was started with
original, calls = getattr(module, name), [0]
def patched(*args, **kwargs):
    calls[0] += 1
    if calls[0] == call:
        os.kill(os.getpid(), signum)
    return original(*args, **kwargs)
setattr(module, name, patched)
sys.argv = ["corp-deploy", *sys.argv[5:]]
from corp_deploy.launch import main
main()
"""


class Fault(NamedTuple):
    """Send ``signal`` to the run when ``module.function`` is called the ``call``-th time."""

    module: str
    function: str
    call: int
    signal: str
    args: Callable[[Path], list]
    output: str


FAULTS = {
    "compress-sigterm-while-calibrating": Fault(
        "corp_deploy.engine", "embed_tokens", 2, "SIGTERM", lambda w: [*BASE, "-o", w / "art"], "art"
    ),
    "compress-sigint-while-saving-the-weights": Fault(
        "safetensors.torch", "save_file", 1, "SIGINT", lambda w: [*BASE, "-o", w / "art"], "art"
    ),
    "compress-sigint-while-saving-into-new-folders": Fault(
        "safetensors.torch", "save_file", 1, "SIGINT", lambda w: [*BASE, "-o", w / "new" / "deeper" / "art"], "new"
    ),
    "compress-sigterm-while-the-output-is-swapped": Fault(
        "os", "rename", 1, "SIGTERM", lambda w: [*BASE, "--seed", 5, "-o", w / "art"], "art"
    ),
    "compress-sigterm-while-recovering": Fault(
        "corp_deploy.recovery.training",
        "distillation_loss",
        2,
        "SIGTERM",
        lambda w: [*BASE, "--recover-steps", 4, "--recover-batch-size", 2, "-o", w / "art"],
        "art",
    ),
    "recover-sigint-while-recovering": Fault(
        "corp_deploy.recovery.training",
        "distillation_loss",
        2,
        "SIGINT",
        lambda w: ["recover", w / "art", "--recover-steps", 4, "--recover-batch-size", 2, "-o", w / "rec"],
        "rec",
    ),
    "compress-sighup-while-calibrating": Fault(
        "corp_deploy.engine", "embed_tokens", 2, "SIGHUP", lambda w: [*BASE, "-o", w / "art"], "art"
    ),
    "compress-sighup-while-the-output-is-swapped": Fault(
        "os", "rename", 1, "SIGHUP", lambda w: [*BASE, "--seed", 5, "-o", w / "art"], "art"
    ),
    "compress-sigterm-after-the-output-is-complete": Fault(
        "corp_deploy.latest", "record_latest", 1, "SIGTERM", lambda w: [*BASE, "--seed", 5, "-o", w / "art"], "art"
    ),
    "export-sigquit-while-exporting-onnx": Fault(
        "exporters.pipeline", "export_onnx", 2, "SIGQUIT", lambda w: ["export", w / "art", "--dense"], "art/export-fp32"
    ),
    "export-sigusr1-while-exporting-onnx": Fault(
        "exporters.pipeline", "export_onnx", 2, "SIGUSR1", lambda w: ["export", w / "art", "--dense"], "art/export-fp32"
    ),
    "export-sigpwr-while-exporting-onnx": Fault(
        "exporters.pipeline", "export_onnx", 2, "SIGPWR", lambda w: ["export", w / "art", "--dense"], "art/export-fp32"
    ),
    "recover-sigrtmin-plus-2-while-recovering": Fault(
        "corp_deploy.recovery.training",
        "distillation_loss",
        2,
        "SIGRTMIN+2",
        lambda w: ["recover", w / "art", "--recover-steps", 4, "--recover-batch-size", 2, "-o", w / "rec"],
        "rec",
    ),
    "sweep-sigquit-once-its-first-artifact-is-complete": Fault(
        "corp_deploy.outputs",
        "mark_complete",
        1,
        "SIGQUIT",
        lambda w: [
            "sweep",
            *BASE[1:],
            "--s",
            0.5,
            "--batch",
            1,
            "--min-time",
            0.01,
            "--backends",
            "torch",
            "-o",
            w / "sw",
        ],
        "sw",
    ),
    "export-sigterm-while-exporting-onnx": Fault(
        "exporters.pipeline", "export_onnx", 2, "SIGTERM", lambda w: ["export", w / "art", "--dense"], "art/export-fp32"
    ),
    "export-int8-sigterm-while-calibrating-ranges": Fault(
        "onnxruntime.quantization.calibrate",
        "save_tensors_data",
        1,
        "SIGTERM",
        lambda w: [
            "export",
            w / "art",
            "--precision",
            "int8",
            "--int8-keep-float",
            0,
            "--calib-samples",
            4,
            "-o",
            w / "art" / "export-int8",
        ],
        "art/export-int8",
    ),
    "bench-sigterm-while-timing": Fault(
        "benchmarks.harness", "interleaved", 1, "SIGTERM", lambda w: ["bench", w / "art", *BENCH, "-o", w / "b"], "b"
    ),
    "bench-sigterm-while-writing-the-reports": Fault(
        "benchmarks.report",
        "plot",
        1,
        "SIGTERM",
        lambda w: [
            "bench",
            w / "art",
            *BENCH,
            "--backends",
            "torch",
            "--json",
            w / "r.json",
            "--markdown",
            w / "r.md",
            "--plot",
            w / "r.png",
        ],
        "r.json",
    ),
    "sweep-sigint-after-the-first-run": Fault(
        "benchmarks.sweep",
        "export_artifact",
        2,
        "SIGINT",
        lambda w: [
            "sweep",
            *BASE[1:],
            "--s",
            "0.3,0.5",
            "--backends",
            "torch",
            "--batch",
            1,
            "--min-time",
            0.01,
            "--data-samples",
            2,
            "-o",
            w / "sweep",
        ],
        "sweep",
    ),
}


@pytest.fixture(scope="module")
def import_leftovers(tmp_path_factory) -> set[str]:
    """What importing the libraries leaves in the temporary directory by itself (ONNX Runtime's
    ``.ses``, torch's inductor cache folder): not the run's debris."""
    temp = tmp_path_factory.mktemp("imports")
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import corp_deploy.cli, exporters.pipeline, benchmarks.sweep, onnxruntime.quantization",
        ],
        check=True,
        env={**os.environ, "TMPDIR": str(temp)},
    )
    return {p.name for p in temp.iterdir()}


@pytest.mark.slow  # real subprocesses, interrupted
@pytest.mark.parametrize("name", sorted(FAULTS))
def test_an_interrupted_run_leaves_the_previous_output_intact_and_no_debris(name, tmp_path, built, import_leftovers):
    fault = FAULTS[name]
    work, temp = tmp_path / "w", tmp_path / "temp"
    temp.mkdir()
    shutil.copytree(built / "art", work / "art")
    with staged_output(work / "b", "bench") as previous:  # an earlier bench report, to be left intact
        (previous / "bench.json").write_text("{}")
    if name == "bench-sigterm-while-writing-the-reports":  # earlier reports there, all to be left as they were
        code, text, _ = invoke(FAULTS[name].args(work), tmp_path / "state")
        assert code == 0, text
    before = snapshot(work)
    env = {**os.environ, "TMPDIR": str(temp), "CORP_DEPLOY_STATE_DIR": str(tmp_path / "state")}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            FAULT_RUNNER,
            fault.module,
            fault.function,
            str(fault.call),
            fault.signal,
            *map(str, fault.args(work)),
        ],
        capture_output=True,
        text=True,
        cwd=work,
        env=env,
        timeout=600,
    )
    base, _, offset = fault.signal.partition("+")
    code = 128 + getattr(signal, base) + int(offset or 0)
    assert done.returncode == code, done.stderr
    assert f"stopped by {fault.signal}" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not debris(work) and {p.name for p in temp.iterdir()} <= import_leftovers
    after = snapshot(work)
    if name.endswith("-after-the-output-is-complete"):  # the message says so, not "nothing partial"
        assert f"{work / 'art'} was written before it and is complete" in done.stderr, done.stderr
    said = " ".join(done.stderr.split())
    said = said[said.index("stopped by") :]  # the last line: what was and was not written
    if name.startswith("sweep-"):  # the point's artifact went with the sweep's staging folder, unnamed
        assert f"{work / fault.output} was not written (nothing of it is left)" in said and "-s0" not in said, said
        assert not (work / fault.output).exists()
    elif name.endswith("-while-saving-into-new-folders"):
        assert f"{work / 'new' / 'deeper' / 'art'} was not written (nothing of it is left)" in said, said
    elif not name.endswith(("-while-the-output-is-swapped", "-after-the-output-is-complete")):
        assert f"{work / fault.output} was not written" in said, said  # named even before it was begun
    if name.endswith(("-while-the-output-is-swapped", "-after-the-output-is-complete")):
        # the swap is held together: the signal waits for it, so the new artifact is complete
        assert json.loads((work / "art" / "config.json").read_text())["settings"]["seed"] == 5
        verify_files(work / "art", "artifact")
        assert load_compressed(work / "art") is not None
    else:
        assert after == before, f"{fault.output} changed"


def _ends_the_process(signum: int) -> bool:
    """Whether ``signum`` at its default action ends a process, measured: a forked child sends it
    to itself (core dumps off); a child that stops or goes on is not ended by it."""
    pid = os.fork()
    if pid == 0:  # the child: nothing but the signal, then a plain exit
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
        os._exit(0)
    _, status = os.waitpid(pid, os.WUNTRACED)
    if os.WIFSTOPPED(status):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return False
    return os.WIFSIGNALED(status)


def test_every_signal_that_ends_a_process_by_default_is_an_interrupt():
    """The interrupts are every signal of this platform whose default action ends a process (each
    measured in a child), but SIGKILL, the faults a process raises on itself and SIGPIPE / SIGXFSZ,
    which Python ignores: SIGPWR, SIGIO and every real-time signal among them on Linux."""
    from corp_deploy.interrupts import INTERRUPTS, signal_name

    kept_out = {
        "SIGKILL",
        "SIGSEGV",
        "SIGBUS",
        "SIGFPE",
        "SIGILL",
        "SIGABRT",
        "SIGTRAP",
        "SIGSYS",
        "SIGPIPE",
        "SIGXFSZ",
    }
    others = [s for s in signal.valid_signals() if signal_name(s) not in kept_out]
    ending = {signal_name(s) for s in others if _ends_the_process(s)}
    assert {signal_name(s) for s in INTERRUPTS} == ending
    assert {"SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1"} <= ending
    if sys.platform.startswith("linux"):
        assert {"SIGPWR", "SIGIO", "SIGRTMIN+2", "SIGRTMAX"} <= ending


INTERRUPT_EVERY_WAY = """
import io, json, os, shutil, signal, sys, tempfile, time
from pathlib import Path
import click
from corp_deploy import launch
from corp_deploy.cli import cli
from corp_deploy.interrupts import INTERRUPTS
from corp_deploy.outputs import staged_output

@cli.command("stage")
@click.argument("dest")
@click.argument("signum", type=int)
def stage(dest, signum):
    # an output being staged and a temporary folder, as export has them, when the signal comes
    with staged_output(Path(dest), "bench") as tmp, tempfile.TemporaryDirectory(prefix="corp-deploy-export-"):
        (tmp / "bench.json").write_text("{}")
        os.kill(os.getpid(), signum)
        time.sleep(1)

dest, ignored = Path(sys.argv[1]), sys.argv[2:]
for signum in INTERRUPTS:
    for each in INTERRUPTS:  # a fresh process's dispositions (main ignores every one once it is done)
        signal.signal(each, signal.SIG_IGN if str(int(each)) in ignored else signal.SIG_DFL)
    sys.argv, sys.stderr = ["corp-deploy", "stage", str(dest), str(int(signum))], io.StringIO()
    try:
        launch.main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    said, sys.stderr = sys.stderr.getvalue(), sys.__stderr__
    print(json.dumps([int(signum), code, said, sorted(p.name for p in dest.parent.iterdir())]), flush=True)
    shutil.rmtree(dest, ignore_errors=True)  # the next run starts without this one's output
"""


@pytest.mark.slow  # a subprocess runs the command once per signal
def test_every_interrupt_leaves_no_staging_or_temporary_folder(tmp_path):
    """Each interrupt in turn (every signal of :data:`corp_deploy.interrupts.INTERRUPTS`, real-time
    ones included) stops a command that is staging an output and holds a temporary folder: 128 + N,
    one line naming the signal, no staging folder and nothing in the temporary directory. A signal
    the process was started ignoring (SIGHUP under ``nohup``) stays ignored: the command completes."""
    from corp_deploy.interrupts import INTERRUPTS, signal_name

    work, temp = tmp_path / "w", tmp_path / "temp"
    work.mkdir(), temp.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPT_EVERY_WAY, str(work / "out"), str(int(signal.SIGHUP))],
        capture_output=True,
        text=True,
        env={**os.environ, "TMPDIR": str(temp), "CORP_DEPLOY_STATE_DIR": str(tmp_path / "state")},
        timeout=600,
    )
    runs = {signum: (code, said, left) for signum, code, said, left in map(json.loads, done.stdout.splitlines())}
    assert sorted(runs) == sorted(map(int, INTERRUPTS)), done.stderr
    for signum, (code, said, left) in runs.items():
        if signum == signal.SIGHUP:  # ignored from the start: the output is written
            assert code == 0 and left == ["out"], (said, left)
            continue
        assert code == 128 + signum and said.count("\n") == 2, said  # a blank line, then the message
        assert f"stopped by {signal_name(signum)}; {work / 'out'} was not written" in said, said
        assert left == [], (signal_name(signum), left)
    assert list(temp.iterdir()) == []


@pytest.mark.parametrize("exporter", [["--exporter", "torchscript"], ["--opset", "17"]])
def test_library_warnings_stay_off_the_terminal(tmp_path, built, exporter):
    """The exporters, timm and ONNX Runtime warn a lot (the dynamo exporter logs that it converts
    opset 18 down to 17); through the command only corp-deploy speaks."""
    shutil.copytree(built / "art", tmp_path / "art")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "corp_deploy.launch",
            "export",
            str(tmp_path / "art"),
            "--dense",
            *exporter,
            "-o",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "CORP_DEPLOY_STATE_DIR": str(tmp_path / "state")},
    )
    assert done.returncode == 0, done.stderr
    assert not re.search(r"warn|deprecat", done.stderr, flags=re.I), done.stderr


LOADING_INTERRUPTED = """
import os, signal, sys
if sys.argv[1] == "ignored":  # as a script's background job starts it (POSIX: SIGINT ignored)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
loading = sys.argv[2]
class Hook:  # the named point: the import of ``loading``, which every command makes, sends the signal
    def find_spec(self, name, path, target=None):
        if name == loading:
            open("reached", "w").close()
            os.kill(os.getpid(), signal.SIGINT)
sys.meta_path.insert(0, Hook())
sys.argv = ["corp-deploy", *sys.argv[3:]]
from corp_deploy.launch import main
main()
"""


@pytest.mark.parametrize("started", ["at-default", "ignored"])
@pytest.mark.parametrize("loading", ["timm", "corp_deploy.errors"], ids=["timm", "the-entry-points-own-imports"])
def test_an_interrupt_while_the_libraries_load_exits_cleanly(tmp_path, started, loading):
    """SIGINT while the command imports torch and timm (the first seconds of every run), or while the
    entry point loads its own imports before its handlers are in place (Ctrl-C just after Enter: a
    25-line KeyboardInterrupt traceback, found by the hostile sweep), stops it: 130, one line, nothing
    written. Started with SIGINT ignored (a script's background job, as CI may start the suite: why
    this test once failed) the signal stays ignored and the command completes."""
    args = [*map(str, BASE), "-o", "out"]
    prefix = AS_A_FOREGROUND_JOB if started == "at-default" else ""
    done = subprocess.run(
        [sys.executable, "-c", prefix + LOADING_INTERRUPTED, started, loading, *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "CORP_DEPLOY_STATE_DIR": str(tmp_path / "state")},
    )
    assert (tmp_path / "reached").exists(), done.stderr  # the signal was sent while that module loaded
    assert "Traceback" not in done.stderr, done.stderr
    if started == "ignored":
        assert done.returncode == 0, done.stderr
        verify_files(tmp_path / "out", "artifact")
        return
    assert done.returncode == 130 and "stopped by SIGINT" in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reached"]


# ---------------------------------------------------------------- the documented table


def test_docs_list_every_case():
    text = DOC.read_text()
    documented = set(re.findall(r"^\| `([a-z0-9-]+)` \|", text, flags=re.M))
    cases = (
        set(REFUSALS)
        | set(FAULTS)
        | {
            name[len("test_") :].replace("_", "-")
            for name in globals()
            if name.startswith("test_")
            and name
            not in (
                "test_refused_with_one_message_and_nothing_changed",
                "test_an_interrupted_run_leaves_the_previous_output_intact_and_no_debris",
                "test_docs_list_every_case",
            )
        }
    )
    assert documented == cases, (sorted(cases - documented), sorted(documented - cases))


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


def test_sparsity_zero_says_the_artifact_is_the_dense_model(tmp_path):
    """``--s 0`` is accepted (the exactness check: every dim kept) and says so, rather than
    finishing as if it had compressed."""
    code, text, _ = invoke([*BASE, "--s", "0", "-o", tmp_path / "art"], tmp_path / "state")
    assert code == 0 and "every sparsity is 0: every dim is kept" in " ".join(text.split()), text
    code, text, _ = invoke([*BASE, "--s", "0.5", "-o", tmp_path / "half"], tmp_path / "state")
    assert code == 0 and "every sparsity is 0" not in text, text


def test_the_library_refuses_an_output_that_is_its_own_input(tmp_path, built):
    """``recover_artifact`` into the artifact it reads (or inside it), ``compress_to_artifact`` into
    its calibration folder: refused up front as the commands refuse them; nothing is changed."""
    from corp_deploy import CalibrationSpec, CompressConfig, compress_to_artifact, recover_artifact
    from corp_deploy.recovery import RecoveryConfig
    from tests.helpers import build_small_vit

    art = tmp_path / "art"
    shutil.copytree(built / "art", art)
    before = sorted((p.relative_to(art), p.read_bytes()) for p in art.rglob("*") if p.is_file())
    for out in (art, art / "sub"):
        with pytest.raises(CorpError, match="the artifact to recover"):
            recover_artifact(art, RecoveryConfig(steps=2), out)
    assert sorted((p.relative_to(art), p.read_bytes()) for p in art.rglob("*") if p.is_file()) == before
    calib = image_folder(tmp_path / "calib")
    with pytest.raises(CorpError, match="lies inside the calibration folder"):
        compress_to_artifact(build_small_vit(), CompressConfig(), CalibrationSpec(calib, samples=4), calib / "out")
    assert sorted(p.name for p in calib.iterdir()) == ["0.png", "1.png", "2.png", "3.png"]


def test_an_opset_whose_attention_the_exporter_cannot_write_is_refused_before_the_export(monkeypatch):
    """An opset ONNX Runtime knows but the exporter cannot write attention in (torch 2.14's dynamo
    exporter at opset 26) is refused as a value, with the highest that works, before any export;
    the probe is a real export of a tiny attention block, loaded and run by ONNX Runtime."""
    from corp_deploy.errors import SettingError
    from exporters import onnx_export

    assert onnx_export.writes_attention("dynamo", onnx_export.DEFAULT_OPSET + 1)  # the real probe
    highest = onnx_export.max_opset("dynamo")
    monkeypatch.setattr(onnx_export, "writes_attention", lambda exporter, opset: opset <= highest - 2)
    onnx_export.check_settings(highest - 2, "dynamo")
    with pytest.raises(SettingError, match=f"must be between 17 and {highest - 2} with the dynamo exporter"):
        onnx_export.check_settings(highest, "dynamo")


def test_an_opset_the_exporter_cannot_write_is_one_message(tmp_path, monkeypatch):
    """An opset in the supported range that torch's exporter still fails on for this model (its
    attention at opset 26 with torch 2.14, say): one message naming the exporter and the opset, not
    "a bug"; an OS error inside the exporter stays an OS error."""
    from exporters import onnx_export

    def fails(*args):
        raise ValueError("No Op registered for Attention with domain_version of 18")

    monkeypatch.setattr(onnx_export, "_run_exporter", fails)
    with pytest.raises(CorpError, match="the dynamo exporter could not write a valid opset-18 graph of this model"):
        onnx_export.export_onnx(build_small_vit_model(), tmp_path / "m.onnx", (3, 32, 32))

    def disk_full(*args):
        raise RuntimeError("serialisation failed") from OSError(28, "No space left on device")

    monkeypatch.setattr(onnx_export, "_run_exporter", disk_full)
    with pytest.raises(RuntimeError, match="serialisation failed"):
        onnx_export.export_onnx(build_small_vit_model(), tmp_path / "m.onnx", (3, 32, 32))
    assert list(tmp_path.iterdir()) == []


def build_small_vit_model():
    from tests.helpers import build_small_vit

    return build_small_vit()


def test_the_library_names_a_model_that_compress_cannot_take(image_batches):
    """``compress(None, ...)`` names the wrong type; a float16 model is told to be cast, not blamed
    on the images."""
    from corp_deploy import CompressConfig, compress
    from corp_deploy.errors import BadUsage
    from tests.helpers import build_small_vit

    batches = image_batches(1, 4)
    with pytest.raises(BadUsage, match="model must be a Module, not NoneType"):
        compress(None, batches, CompressConfig())
    with pytest.raises(BadUsage, match=r"weights are float16; compress takes a float32 model \(call model.float"):
        compress(build_small_vit().half(), batches, CompressConfig())


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


def test_an_edited_bench_markdown_report_is_not_replaced(tmp_path, built):
    """bench's Markdown report ends with the digest of what it wrote: a later run replaces it while
    it is unedited, and refuses once someone added to it (their words are kept)."""
    report = tmp_path / "r.md"
    args = ["bench", built / "art", *BENCH, "--backends", "torch", "--markdown", report]
    for _ in range(2):
        code, text, _ = invoke(args, tmp_path / "state")
        assert code == 0, text
    report.write_text(report.read_text() + "Sign-off: approved, keep this\n")
    code, text, _ = invoke(args, tmp_path / "state")
    assert code == 1 and "refusing to overwrite" in text and "edited" in text, text
    assert report.read_text().endswith("Sign-off: approved, keep this\n")


def test_the_follow_up_command_of_an_unverified_export_is_the_whole_command(tmp_path, built):
    """A bf16 export that cannot be checked here prints the command to run on a GPU machine with the
    artifact and every option given (never a command that would export another artifact there)."""
    code, text, _ = invoke(["export", built / "art", "--precision", "bf16", "--dense", "-o", tmp_path / "x"], tmp_path)
    assert code == 3, text
    assert f"corp-deploy export {built / 'art'} --precision bf16 --dense -o {tmp_path / 'x'}" in text, text


def test_a_parity_cosine_below_its_limit_is_printed_with_the_digits_that_show_it():
    """``--min-parity-cosine 1.0`` against a cosine of 0.99999999: the gate's line shows it below
    the limit, never ``1.000000 < 1.0``."""
    from benchmarks.gate import GateLimits, regressions
    from benchmarks.results import BenchReport

    numbers = {"max_abs": 1e-7, "max_rel": 1e-6, "cosine": 0.99999999, "top1_agreement": None}
    report = BenchReport.from_dict(
        {"format": "corp-deploy-bench", "latency": [], "fidelity": {}, "parity": {"dense": {"ort-cpu": numbers}}}
    )
    assert regressions(report, GateLimits(min_parity_cosine=1.0)) == [
        "parity: dense on ort-cpu vs torch-cpu fp32: cosine 0.99999999 < 1.0"
    ]


def test_a_batch_profile_of_the_wrong_type_is_named():
    """``ExportOptions(batch=(1, 8, 32))``: one BadUsage naming the type, not an AttributeError deep
    inside the export."""
    from corp_deploy.errors import BadUsage
    from exporters.options import ExportOptions

    with pytest.raises(BadUsage, match="batch must be a BatchProfile, not tuple"):
        ExportOptions(batch=(1, 8, 32))


def test_an_edited_bench_json_report_is_not_replaced(tmp_path, built):
    """bench's JSON report ends with the digest of its other entries: a later run replaces it while
    it is unedited, and refuses once someone added an entry or removed the digest (theirs is kept);
    as a baseline it reads as before."""
    report = tmp_path / "r.json"
    args = ["bench", built / "art", *BENCH, "--backends", "torch", "--json", report]
    for _ in range(2):
        code, text, _ = invoke(args, tmp_path / "state")
        assert code == 0, text
    baseline = ["--baseline", report, "--gate", "fidelity"]  # timings move with the machine's load
    code, text, _ = invoke([*args[:-1], tmp_path / "next.json", *baseline], tmp_path / "state")
    assert code == 0, text
    data = json.loads(report.read_text())
    report.write_text(json.dumps({**data, "note": "approved, keep this"}, indent=2))
    code, text, _ = invoke(args, tmp_path / "state")
    assert code == 1 and "refusing to overwrite" in text and "edited" in text, text
    assert json.loads(report.read_text())["note"] == "approved, keep this"
    for own in (  # no digest: not known to be bench's, whatever its format entry says
        {"format": "corp-deploy-bench", "mine": True},
        {key: value for key, value in data.items() if key != "sha256_of_the_report_above"},
    ):
        report.write_text(json.dumps(own))
        code, text, _ = invoke(args, tmp_path / "state")
        assert code == 1 and "refusing to overwrite" in text, text
        assert json.loads(report.read_text()) == own
