"""Option groups that several commands share (Polygraphy's argument groups are the model),
the option types with their ranges, and the parsers of option values."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ..calibration import DEFAULT_IMAGES
from ..errors import BadUsage
from ..files import checked_path
from ..methods import METHODS
from ..parts import TARGETS
from ..recovery import MAX_STEPS, SETTING_PREFIX, RecoveryConfig
from ..resources import MAX_BATCH
from .group import option_name

#: The largest seed every random generator used here accepts.
MAX_SEED = 2**32 - 1


class FiniteFloatRange(click.FloatRange):
    """A float range that refuses NaN and infinities (click's ranges let NaN through)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{number} is not a finite number", param, ctx)
        return number


class GivenPath(click.Path):
    """A path that names something the tool can use (:func:`corp_deploy.files.checked_path`): an
    empty value (``--calib ""``, an unset shell variable) is refused, not read as the current
    directory, and so is a path that is not valid UTF-8."""

    def convert(self, value, param, ctx):
        try:
            checked_path(value, "the path")
        except BadUsage as exc:
            self.fail(str(exc), param, ctx)
        return super().convert(value, param, ctx)


class CommaList(click.ParamType):
    """Comma-separated items (``1,8,32``, ``speedup,fidelity``), each converted by ``item``: the one
    parser of every list option. An empty item (``1,,2``, ``0.5,``, ``,speedup``) is refused, not
    dropped. ``what`` names the items and ``example`` shows the form in messages; what the items may
    be (names of backends or gates, ...) is checked where they are used. ``name``: the metavar in --help."""

    def __init__(self, item: Callable[[str], Any], what: str, example: str, name: str = "NAMES") -> None:
        self.item, self.what, self.example, self.name = item, what, example, name

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        items = [text.strip() for text in value.split(",")]
        try:
            if "" in items:
                raise ValueError("an empty item")
            return tuple(self.item(text) for text in items)
        except ValueError:
            empty = ": an empty item is refused, not dropped" if "" in items else ""
            self.fail(f"takes comma-separated {self.what} (e.g. {self.example}); got {value!r}{empty}", param, ctx)


class BatchSizes(CommaList):
    """Comma-separated batch sizes (``1,8,32``): positive integers, each once."""

    def __init__(self) -> None:
        super().__init__(int, "positive integers", "1,8,32", "SIZES")

    def convert(self, value, param, ctx):
        sizes = super().convert(value, param, ctx)
        if min(sizes) < 1:
            self.fail(f"takes comma-separated positive integers (e.g. 1,8,32); got {value!r}", param, ctx)
        if max(sizes) > MAX_BATCH:
            self.fail(
                f"takes batch sizes up to {MAX_BATCH} (the exported graphs' batch range; far beyond any "
                f"machine's memory for a ViT); got {max(sizes)}",
                param,
                ctx,
            )
        repeated = sorted({size for size in sizes if sizes.count(size) > 1})
        if repeated:
            self.fail(f"gives batch size {', '.join(map(str, repeated))} more than once: {value!r}", param, ctx)
        return sizes


#: Every path option and argument.
PATH = GivenPath(path_type=Path)
#: How many images an option may ask for (a decoded 224 px image is 0.6 MB).
IMAGE_COUNT = click.IntRange(1, 10_000_000)  # calibration.MAX_IMAGES (not imported here: --help loads no torch)
#: CPU threads: at most four per core (more only slows the run, and far more crashes the runtimes).
THREADS = click.IntRange(1, 4 * (os.cpu_count() or 1))
#: A positive, finite number of seconds, at most an hour (a time per measurement: more never ends
#: in practice).
SECONDS = FiniteFloatRange(min=0, min_open=True, max=3600)


def options(*options):
    """Apply click options in the order listed (so they appear in that order in --help)."""

    def apply(func):
        for option in reversed(options):
            func = option(func)
        return func

    return apply


def _field_option(field: dataclasses.Field, lead: str, prefix: str = ""):
    """The click option of a :func:`corp_deploy.methods.base.option` field: ``--<prefix><name>``,
    its help text led by ``lead``."""
    meta = field.metadata
    text = f"{lead}{meta['help']}"
    if meta["default_help"]:
        text += f" [default: {meta['default_help']}]"
    flag = meta["value_type"] is bool
    value_type = None if flag else click.Choice(meta["choices"]) if meta["choices"] else meta["value_type"]
    return click.option(
        option_name(prefix + field.name),
        is_flag=flag,
        type=value_type,
        default=field.default,
        show_default=not flag and field.default is not None,
        metavar=meta["metavar"],
        help=text,
    )


def method_options(func):
    """Every method's options (:func:`corp_deploy.methods.base.option` fields of its options
    class) as ``--<name>`` options, each help text led by the method's name."""
    for method in reversed(METHODS.values()):
        for field in reversed(method.options_class.fields()):
            if "help" in field.metadata:
                func = _field_option(field, f"{method.name}: ")(func)
    return func


def recovery_options(func=None, *, steps: int | None = None):
    """The recovery's command-line settings (:class:`corp_deploy.recovery.RecoveryConfig` fields
    made with ``option``) as ``--recover-<name>`` options. ``steps``: the default number of steps of
    a command that always recovers (``recover``; 0, off, is then refused), instead of the field's 0."""
    if func is None:
        return lambda func: recovery_options(func, steps=steps)
    for field in reversed(dataclasses.fields(RecoveryConfig)):
        if "help" not in field.metadata:
            continue
        if field.name == "steps" and steps is not None:
            func = click.option(
                option_name(SETTING_PREFIX + field.name),
                type=click.IntRange(1, MAX_STEPS),
                default=steps,
                show_default=True,
                help="Distillation steps (recovery stops earlier when its validation images stop improving).",
            )(func)
        else:
            func = _field_option(field, "", SETTING_PREFIX)(func)
    return func


#: Which dense model to start from and what to calibrate on (shared by compress and sweep).
model_source_options = options(
    click.argument("model"),
    click.option(
        "--target",
        type=click.Choice(TARGETS),
        default=None,
        help="Which parts to prune. [default: the method's: "
        + ", ".join(f"{m.default_target} for {m.name}" for m in METHODS.values())
        + "]",
    ),
    click.option(
        "--calib",
        type=PATH,
        default=None,
        help="Directory of unlabelled deployment images (recursive; jpg/png/webp/bmp). "
        "Default: built-in photos from scikit-image.",
    ),
    click.option(
        "--calib-samples",
        type=IMAGE_COUNT,
        default=DEFAULT_IMAGES,
        show_default=True,
        help="Number of calibration images.",
    ),
    click.option(
        "--calib-crops/--no-calib-crops",
        default=True,
        show_default=True,
        help="Fill --calib-samples with seeded random crops and flips of the --calib images when the folder "
        "holds fewer (each file whole first); --no-calib-crops: the files alone.",
    ),
    click.option(
        "--model-arg",
        "model_args",
        multiple=True,
        metavar="KEY=VALUE",
        help="timm creation argument, repeatable (e.g. img_size=224, num_classes=0).",
    ),
    click.option(
        "--checkpoint",
        type=PATH,
        default=None,
        help="Local weights: .safetensors, or .pth/.pt state dict (loaded with weights_only=True).",
    ),
    click.option("--no-pretrained", is_flag=True, help="Random weights (for trying the tool)."),
    click.option(
        "--seed",
        type=click.IntRange(0, MAX_SEED),
        default=0,
        show_default=True,
        help="Seed for calibration sampling/augmentation and random weights.",
    ),
)


def smoothing_strength(ctx, param, value: str) -> float | None:
    """``--int8-smoothing``: ``none`` or a strength from 0 to 1."""
    if value == "none":
        return None
    try:
        alpha = float(value)
    except ValueError:
        alpha = -1.0
    if not 0 <= alpha <= 1:
        raise click.BadParameter(f"expected 'none' or a number from 0 to 1, got {value!r}")
    return alpha


def keep_float_count(ctx, param, value: str) -> int | str:
    """``--int8-keep-float``: ``auto`` or a count >= 0."""
    if value == "auto":
        return value
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise click.BadParameter(f"expected 'auto' or a number >= 0, got {value!r}")
    return count


def parse_model_args(pairs: tuple[str, ...]) -> dict:
    """``KEY=VALUE`` strings to a dict; values are parsed as JSON when they can be (``true``,
    ``3``, ``[32, 48]``), Python's ``True``/``False``/``None`` too. BadUsage for a key given twice
    and for a yes/no word that is not JSON (``no``: timm would read the string as true)."""
    out = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise BadUsage(f"--model-arg expects KEY=VALUE, got {pair!r}")
        if key in out:
            raise BadUsage(f"--model-arg {key} is given more than once; give it once")
        try:
            out[key] = json.loads(_PYTHON_LITERALS.get(raw, raw))
        except json.JSONDecodeError:
            if raw.lower() in _TRUTH_WORDS:
                raise BadUsage(
                    f"--model-arg {pair}: write a yes/no value as true or false ({raw!r} would reach timm "
                    "as a string, which counts as true)"
                ) from None
            out[key] = raw
    return out


_PYTHON_LITERALS = {"True": "true", "False": "false", "None": "null"}
_TRUTH_WORDS = {"yes", "no", "on", "off", "y", "n", "true", "false", "t", "f"}


#: What is timed, where, and for how long (bench, sweep).
timing_options = options(
    click.option(
        "--backends",
        type=CommaList(str, "backend families", "torch,ort"),
        default="torch,ort,trt",
        show_default=True,
        help="Backend families: torch (CPU, CUDA), torch-compile (torch.compile with inductor: CPU, CUDA), ort "
        "(CPU, CUDA and TensorRT providers), trt (engines).",
    ),
    click.option(
        "--batch", "batches", type=BatchSizes(), default="1,8,32", show_default=True, help="Batch sizes to time."
    ),
    click.option(
        "--threads", type=THREADS, default=None, help="CPU threads for PyTorch and ONNX Runtime. [default: PyTorch's]"
    ),
    click.option(
        "--min-time",
        type=SECONDS,
        default=2.0,
        show_default=True,
        help="Seconds each model is timed per backend and batch size (at least 5 rounds).",
    ),
    click.option(
        "--torch-precision",
        type=click.Choice(["fp32", "fp16", "bf16"]),
        default="fp32",
        show_default=True,
        help="What the torch backends run in: fp16 on CUDA only, bf16 on CUDA and the CPU (the model "
        "and images cast; parity is still against fp32 on the CPU).",
    ),
    click.option(
        "--timing",
        type=click.Choice(["device-resident", "host-to-host"]),
        default="device-resident",
        show_default=True,
        help="The figure speedups and gates use on a GPU: device-resident (images staged on the GPU once, "
        "outputs left there, CUDA events: what the model costs) or host-to-host (pinned host arrays in and "
        "out, the copies included: what a pipeline handing over host arrays pays); the other is reported "
        "beside it. On the CPU the two are one measurement.",
    ),
    click.option(
        "--cuda-graphs",
        is_flag=True,
        help="The torch backends on CUDA replay CUDA graphs, one per batch size (torch-compile: inductor's "
        "reduce-overhead mode): small batches no longer wait for kernel launches.",
    ),
)

#: The held-out images fidelity is measured on (bench, sweep).
evaluation_options = options(
    click.option(
        "--data",
        type=PATH,
        default=None,
        help="Held-out images for fidelity (kept out of calibration); a class_index.json makes it "
        "labelled (ImageFolder layout, see docs/bench.md). [default: 5 bundled photos kept out of "
        "calibration]",
    ),
    click.option(
        "--data-samples", type=IMAGE_COUNT, default=256, show_default=True, help="At most this many evaluation images."
    ),
)
