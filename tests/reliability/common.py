"""What the reliability cases share: the command run in-process, snapshots of a case's folder and
the debris check, the one-message assertion, image folders and the baseline files the cases build."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from PIL import Image

from corp_deploy.cli import cli
from tests.helpers import SMALL_VIT_CLI_ARGS as TINY

BASE = ["compress", "deit_tiny", "--no-pretrained", *TINY, "--calib-samples", "4"]


BENCH = ["--batch", "1", "--min-time", "0.01", "--warmup", "0", "--data-samples", "2"]


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


def flip_byte(path: Path, offset: int = 4000) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


def baseline_file(w: Path, change: Callable[[dict], None] | None = None, text: str | None = None) -> Path:
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


def with_int8(report: dict) -> None:
    report["int8"] = {
        "latency": [{"batch": 1, "speedup_over_dense_fp32": {"compressed-int8": {"median": 2.0}}}],
        "fidelity": {"compressed-int8": {"cosine_mean": 0.99}},
    }


def labelled_folder(w: Path, mapping: dict | str) -> Path:
    root = w / "val"
    image_folder(root / "cats", 2)
    (root / "class_index.json").write_text(mapping if isinstance(mapping, str) else json.dumps(mapping))
    return root
