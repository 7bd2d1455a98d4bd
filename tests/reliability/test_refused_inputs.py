"""Bad input gets one message and a non-zero exit, before the expensive work, and nothing is changed:
every refused input of every command (the REFUSALS table), every option out of its range, and the
library's public functions checking what they are given as the command line does."""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import click
import numpy as np
import pytest
import timm
import torch
from safetensors.torch import load_file, save_file

import corp_deploy
import corp_deploy.engine
from benchmarks.gate import GateLimits, read_baseline
from benchmarks.results import BenchSettings
from corp_deploy import (
    CalibrationSpec,
    CompressConfig,
    CorpError,
    compress,
    compress_to_artifact,
    count_macs,
    create_base_model,
    load_compressed,
    model_transform,
    recover_artifact,
    save_artifact,
)
from corp_deploy.cli import cli
from corp_deploy.errors import BadUsage, SettingError
from corp_deploy.methods import CorpOptions
from corp_deploy.models import load_checkpoint
from corp_deploy.outputs import RECORD_FILE, staged_output, write_record
from corp_deploy.recovery import RecoveryConfig, recover
from exporters import ExportOptions, export_artifact, onnx_export
from exporters.parity import Tolerance
from tests.helpers import SMALL_VIT_CLI_ARGS as TINY
from tests.helpers import SMALL_VIT_KWARGS, build_small_vit
from tests.reliability.common import (
    BASE,
    BENCH,
    assert_one_message,
    baseline_file,
    bomb,
    debris,
    flip_byte,
    image_folder,
    invoke,
    labelled_folder,
    plain,
    png,
    setting,
    snapshot,
    with_int8,
)


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


def rewrite(path: Path, change: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def rerecord(folder: Path, kind: str) -> None:
    """Rewrite ``folder``'s record to match its files: what someone who edits files and record alike does."""
    (folder / RECORD_FILE).unlink()
    write_record(folder, kind)


class Refusal(NamedTuple):
    args: Callable[[Path], list]
    code: int
    message: str
    hide_cuda: bool = False  # run as on a machine without a GPU (the case is about its absence)


def _checkpoint(w: Path, change: Callable[[dict], dict], suffix=".safetensors") -> Path:

    state = build_small_vit().state_dict()
    path = w / f"weights{suffix}"
    state = change(state)
    if suffix == ".safetensors":
        save_file(state, str(path))
    else:
        torch.save(state, path)
    return path


def _other_size(state):

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


def _rewritten_with_record(folder: Path, name: str, kind: str, text: str) -> Path:
    (folder / name).write_text(text)
    rerecord(folder, kind)
    return folder


def _symlink_loop(w: Path) -> Path:
    (w / "loop1").symlink_to(w / "loop2")
    (w / "loop2").symlink_to(w / "loop1")
    return w / "loop1"


def _moved_export(w: Path) -> Path:
    shutil.copytree(w / "art" / "export-fp32", w / "other" / "export-fp32")
    return w / "other"


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


def _backbone(w: Path) -> Path:
    code, text, _ = invoke([*BASE, "--model-arg", "num_classes=0", "-o", w / "backbone"], w.parent / "state")
    assert code == 0, text
    return w / "backbone"


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


def _recorded_calib_gone(w: Path, replaced_by_a_file: bool = False) -> Path:
    """An artifact calibrated on a folder that was removed since (and a file written in its place)."""
    calib = image_folder(w / "calib")
    code, text, _ = invoke([*BASE, "--calib", calib, "-o", w / "calibrated"], w.parent / "state")
    assert code == 0, text
    shutil.rmtree(calib)
    if replaced_by_a_file:
        calib.write_text("not a folder")
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
        lambda w: ["bench", w / "art", *BENCH, "--baseline", baseline_file(w), "--gate", "speedup,"],
        2,
        "takes comma-separated gate names (e.g. speedup,fidelity); got 'speedup,': an empty item is refused",
    ),
    "bench-gate-leading-comma": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--baseline", baseline_file(w), "--gate", ",speedup"],
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
            baseline_file(w, lambda r: r["fidelity"].update(feature_cosine=None)),
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
        "config.json is malformed: blocks must be a list, not a string",
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
        "config.json does not describe a model this corp-deploy can rebuild: blocks row 0.mlp_hidden must be in "
        "[0, 192] (the dense block's), not 1000000000000000000000000000000",
    ),
    "export-config-of-other-heads-with-its-record": Refusal(
        lambda w: [
            "export",
            _edited_with_record(w / "art", "config.json", "artifact", lambda c: c["blocks"][1].update(num_heads=2)),
            "-o",
            w / "o",
        ],
        1,
        "config.json does not describe a model this corp-deploy can rebuild: blocks row 1.num_heads is 2; the "
        "dense block has 3",
    ),
    "recover-config-of-another-depth-with-its-record": Refusal(
        lambda w: [
            "recover",
            _edited_with_record(
                w / "art", "config.json", "artifact", lambda c: c["base_model"]["model_kwargs"].update(depth=1)
            ),
            "--recover-steps",
            2,
            "-o",
            w / "o",
        ],
        1,
        "do not match its config.json: 12 unexpected tensors (e.g. blocks.1.attn.proj.bias",
    ),
    "recover-config-of-other-classes-with-its-record": Refusal(
        lambda w: [
            "recover",
            _edited_with_record(
                w / "art", "config.json", "artifact", lambda c: c["base_model"]["model_kwargs"].update(num_classes=10)
            ),
            "--recover-steps",
            2,
            "-o",
            w / "o",
        ],
        1,
        "do not match its config.json: 2 tensors of other shapes (e.g. head.weight: [1000, 48] in model.safetensors, "
        "[10, 48] in the model config.json describes)",
    ),
    "recover-config-settings-out-of-range-with-its-record": Refusal(
        lambda w: [
            "recover",
            _edited_with_record(w / "art", "config.json", "artifact", lambda c: c["settings"].update(s_mlp=5)),
            "--recover-steps",
            2,
            "-o",
            w / "o",
        ],
        1,
        "records compression settings this corp-deploy cannot use: s_mlp must be in [0, 1), got 5",
    ),
    "recover-config-unknown-calibration-source-with-its-record": Refusal(
        lambda w: [
            "recover",
            _edited_with_record(
                w / "art", "config.json", "artifact", lambda c: c["calibration"].update(source="elsewhere")
            ),
            "--recover-steps",
            2,
            "-o",
            w / "o",
        ],
        1,
        "config.json is malformed: calibration.source must be one of 'directory', 'builtin', not 'elsewhere'",
    ),
    "export-config-other-preprocessing-with-its-record": Refusal(
        lambda w: [
            "export",
            _edited_with_record(
                w / "art", "config.json", "artifact", lambda c: c["input"]["data_config"].update(mean=[0.1, 0.2, 0.3])
            ),
            "-o",
            w / "o",
        ],
        1,
        "config.json is malformed: input.data_config.mean [0.1, 0.2, 0.3] is not the preprocessing of the model it "
        "describes ([0.485, 0.456, 0.406])",
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
    "export-int8-recorded-calibration-now-a-file": Refusal(
        lambda w: ["export", _recorded_calib_gone(w, replaced_by_a_file=True), "--precision", "int8", "-o", w / "o"],
        1,
        "which is not a folder any more; pass the calibration images with --calib DIR",
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
    "recover-config-calibration-folder-null-with-its-record": Refusal(
        lambda w: [
            "recover",
            _edited_with_record(
                w / "art",
                "config.json",
                "artifact",
                lambda c: c.update(calibration={"source": "directory", "path": None}),
            ),
            "-o",
            w / "o",
        ],
        1,
        "config.json is malformed: calibration.path needs the calibration folder (a string) for the source 'directory'",
    ),
    "bench-config-pixel-digests-null-with-its-record": Refusal(
        lambda w: [
            "bench",
            _edited_with_record(
                w / "art", "config.json", "artifact", lambda c: c["calibration"].update(pixel_digests=None)
            ),
            *BENCH,
        ],
        1,
        "config.json is malformed: calibration.pixel_digests must be a list of strings",
    ),
    "bench-config-checkpoint-weights-without-their-path-with-its-record": Refusal(
        lambda w: [
            "bench",
            _edited_with_record(
                w / "art", "config.json", "artifact", lambda c: c["base_model"].update(weights={"source": "checkpoint"})
            ),
            *BENCH,
        ],
        1,
        "config.json is malformed: base_model: weights needs its path (a string) for the source 'checkpoint'",
    ),
    "export-config-softmax-scale-nan-with-its-record": Refusal(
        lambda w: [
            "export",
            _edited_with_record(w / "art", "config.json", "artifact", lambda c: c["blocks"][0].update(scale=math.nan)),
            "-o",
            w / "o",
        ],
        1,
        "config.json is malformed: blocks row 0.scale must be a finite number > 0, not nan",
    ),
    "export-config-nested-too-deeply-with-its-record": Refusal(
        lambda w: [
            "export",
            _rewritten_with_record(w / "art", "config.json", "artifact", "[" * 100_000 + "]" * 100_000),
            "-o",
            w / "o",
        ],
        1,
        "is not the config.json of a corp-deploy artifact",
    ),
    "bench-export-of-another-artifact": Refusal(
        lambda w: ["bench", _moved_export(w), *BENCH], 1, "was exported from a different version"
    ),
    "bench-baseline-malformed-json": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--baseline", baseline_file(w, text="{not json")],
        1,
        "cannot read baseline",
    ),
    "bench-baseline-zero-latency": Refusal(
        lambda w: [
            "bench",
            w / "art",
            *BENCH,
            "--baseline",
            baseline_file(w, lambda r: r["latency"][0]["compressed"].update(p50_s=0)),
        ],
        1,
        "latency row 0 needs a backend name, a batch size and positive finite times",
    ),
    "bench-baseline-missing-keys": Refusal(
        lambda w: [
            "bench",
            w / "art",
            *BENCH,
            "--baseline",
            baseline_file(w, lambda r: r["latency"][0].pop("speedup")),
        ],
        1,
        "latency row 0 lacks",
    ),
    "bench-baseline-is-a-directory": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--baseline", w / "art"], 1, "is a directory, not a bench JSON report"
    ),
    "bench-baseline-nothing-measured": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--backends", "trt", "--baseline", baseline_file(w)],
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
        lambda w: [
            "bench",
            w / "art",
            *BENCH,
            "--baseline",
            baseline_file(w, _of_model(w, params=10**6, macs=2 * 10**9)),
        ],
        1,
        "compressed model params 1 M in the baseline, ",
    ),
    "bench-baseline-of-another-precision": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--baseline", baseline_file(w, _of_model(w, precision="fp16"))],
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
            baseline_file(w, _of_model(w, exporter="torchscript", opset=17)),
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
            baseline_file(w, lambda r: r["fidelity"].update(data={"source": "builtin", "images": 64})),
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
            baseline_file(
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
            baseline_file(w, lambda r: r["fidelity"].update(feature_cosine=1.5)),
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
            baseline_file(w, lambda r: r.update(settings={"batches": [1, 8], "backends": ["torch", "ort"]})),
        ],
        1,
        "--batch 1,8 in the baseline, 1 here; --backends torch,ort in the baseline, ort here",
    ),
    "bench-a-row-the-baseline-did-not-time": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--backends", "torch,ort", "--baseline", baseline_file(w)],
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
        lambda w: ["bench", w / "art", *BENCH, "--backends", "torch,ort", "--baseline", baseline_file(w, with_int8)],
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
            baseline_file(w, with_int8),
            "--gate",
            "speedup",
        ],
        4,
        "int8: in the baseline but not measured",
    ),
    "bench-gate-unknown": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--baseline", baseline_file(w), "--gate", "speedup,speed"],
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
            baseline_file(w),
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
            baseline_file(w),
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
        lambda w: ["bench", w / "art", *BENCH, "--data", labelled_folder(w, {"cats": 1, "dogs": 2})],
        1,
        "names classes that have no folder",
    ),
    "bench-class-index-beyond-the-outputs": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--data", labelled_folder(w, {"cats": 5000})],
        1,
        "maps a class to output 5000, but the model has 1000 outputs",
    ),
    "bench-labels-for-a-backbone": Refusal(
        lambda w: ["bench", _backbone(w), *BENCH, "--backends", "torch", "--data", labelled_folder(w, {"cats": 1})],
        1,
        "the model has no classifier to score them against",
    ),
    "bench-class-index-malformed": Refusal(
        lambda w: ["bench", w / "art", *BENCH, "--data", labelled_folder(w, "{oops")], 1, "cannot read"
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


def test_a_budget_below_the_floors_is_refused_before_any_image_is_read(work, monkeypatch):
    """A MAC budget the model cannot meet with every unit at its floor is refused before the
    calibration images are read and embedded, every amount in one unit and as a share of the dense model."""

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


def test_the_library_names_wrong_types_and_values_before_any_work(tiny_artifact):
    """The public functions check what they are given, as the CLI does, with one message naming
    the argument (never a raw TypeError, an overflow after compression, or the wrong cause): no
    calibration batches, a seed no generator takes, recovery of 0 steps, raw uint8 pixels and NaN
    (compress's message), a float16 model (its dtype, not "not the weights it was compressed from");
    bench's settings out of range and paths given as bytes."""

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


def test_an_export_refuses_a_dense_model_that_is_not_the_artifacts_base(work):
    """dense.onnx is the unpruned base of model.onnx: another model (other classes, other weights) is
    refused before anything is written, not found later as a parity failure or a bug."""

    for other, message in (
        (build_small_vit(seed=0, num_classes=7), "the dense model has 7 classes and the compressed one 1000"),
        (build_small_vit(seed=1), "patch embedding differs from the compressed model's"),
    ):
        with pytest.raises(CorpError, match=message):
            export_artifact(work / "art", work / "x", ExportOptions(dense=True), dense_model=other)
        assert not (work / "x").exists() and not debris(work)


def test_a_library_artifact_of_a_model_corp_deploy_did_not_build_can_record_its_dense_weights(tmp_path):
    """An artifact written by compress_to_artifact from the caller's own model records its dense
    weights only when told (base_model's "weights"): without a record, export --dense is refused
    with a message that names the record's forms; with one (a checkpoint), it exports the dense graph."""

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


def test_the_library_refuses_an_output_that_is_its_own_input(tmp_path, built):
    """``recover_artifact`` into the artifact it reads (or inside it), ``compress_to_artifact`` into
    its calibration folder: refused up front as the commands refuse them; nothing is changed."""

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

    return build_small_vit()


def test_the_library_names_a_model_that_compress_cannot_take(image_batches):
    """``compress(None, ...)`` names the wrong type; a float16 model is told to be cast, not blamed
    on the images."""

    batches = image_batches(1, 4)
    with pytest.raises(BadUsage, match="model must be a Module, not NoneType"):
        compress(None, batches, CompressConfig())
    with pytest.raises(BadUsage, match=r"weights are float16; compress takes a float32 model \(call model.float"):
        compress(build_small_vit().half(), batches, CompressConfig())


def test_a_batch_profile_of_the_wrong_type_is_named():
    """``ExportOptions(batch=(1, 8, 32))``: one BadUsage naming the type, not an AttributeError deep
    inside the export."""

    with pytest.raises(BadUsage, match="batch must be a BatchProfile, not tuple"):
        ExportOptions(batch=(1, 8, 32))
