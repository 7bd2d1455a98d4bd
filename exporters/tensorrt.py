"""TensorRT engines: availability, the build (Polygraphy's TensorRT backend), a runner, and the
``trtexec`` script that rebuilds the same engine on the target machine.

Engines are built **strongly typed**: the precision is the one written in the ONNX graph
(see :mod:`exporters.precision`), which is the only mode TensorRT 11 has and an explicit
flag on TensorRT 10. TF32 is off, so float32 layers compute in true float32.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from corp_deploy import CorpError
from corp_deploy.errors import SettingError, described

from .onnx_export import INPUT_NAME, OUTPUT_NAME
from .runners import Runner

if TYPE_CHECKING:
    from .precision import Precision

INSTALL_HINT = "pip install 'corp-deploy[trt]'"
SCRIPT_NAME = "build_engine.sh"


@dataclass(frozen=True)
class BatchProfile:
    """The optimisation profile of the batch axis: an engine accepts ``min <= batch <= max``
    and is tuned for ``opt``."""

    min: int = 1
    opt: int = 8
    max: int = 32

    def __post_init__(self) -> None:
        for name in ("min", "opt", "max"):
            if not (isinstance(getattr(self, name), int) and not isinstance(getattr(self, name), bool)):
                raise SettingError(
                    f"{{setting}} takes whole batch sizes; got {described(getattr(self, name))}", "batch"
                )
        if not 1 <= self.min <= self.opt <= self.max:
            raise SettingError(f"{{setting}} (the batch profile) needs 1 <= MIN <= OPT <= MAX; got {self}", "batch")

    @classmethod
    def parse(cls, text: str) -> BatchProfile:
        """``"MIN:OPT:MAX"``, or ``"N"`` for a fixed batch size."""
        parts = text.split(":")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            values = []
        if len(values) == 1:
            values *= 3
        if len(values) != 3:
            raise SettingError(f"{{setting}} expects MIN:OPT:MAX (e.g. 1:8:32) or one size; got {text!r}", "batch")
        return cls(*values)

    def shapes(self, image_shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The min, opt and max input shapes for images of ``image_shape`` ``(C, H, W)``."""
        return tuple((b, *image_shape) for b in (self.min, self.opt, self.max))

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.min}:{self.opt}:{self.max}"


def unavailable_reason() -> str | None:
    """Why TensorRT engines cannot be built here, or None when they can."""
    try:
        import tensorrt  # noqa: F401
    except Exception as exc:  # not installed, or PyPI's placeholder package that fails on import
        return f"the TensorRT Python package cannot be imported ({type(exc).__name__})"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (a TensorRT engine is built on the kind of GPU that runs it)"
    return None


@dataclass(frozen=True)
class EngineBuild:
    """How long an engine took to build (seconds, rounded to 0.01) and on which GPU."""

    build_s: float
    device: str

    def to_dict(self) -> dict:
        return asdict(self)


def build_engine(
    onnx_path: str | Path,
    engine_path: str | Path,
    *,
    batch: BatchProfile,
    image_shape: tuple[int, ...],
    workspace_gb: float | None = None,
    timing_cache: str | Path | None = None,
) -> EngineBuild:
    """Build a serialized engine from ``onnx_path`` into ``engine_path``.

    Strongly typed network, one optimisation profile for the input's batch axis,
    ``workspace_gb`` caps the builder's workspace pool, and ``timing_cache`` is read when it
    exists and updated after the build.
    """
    import tensorrt as trt  # optional (corp-deploy[trt]): loaded only to build an engine
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, NetworkFromOnnxPath, Profile
    from polygraphy.logger import G_LOGGER

    profile = Profile().add(INPUT_NAME, *batch.shapes(image_shape))
    pools = {trt.MemoryPoolType.WORKSPACE: int(workspace_gb * 2**30)} if workspace_gb else None
    cache = str(timing_cache) if timing_cache else None
    config = CreateConfig(
        profiles=[profile],
        memory_pool_limits=pools,
        tf32=False,
        load_timing_cache=cache if cache and Path(cache).is_file() else None,
    )
    build = EngineBytesFromNetwork(
        NetworkFromOnnxPath(str(onnx_path), strongly_typed=True), config=config, save_timing_cache=cache
    )
    start = time.perf_counter()
    try:
        with G_LOGGER.verbosity(G_LOGGER.WARNING):
            engine = build()
    except Exception as exc:  # Polygraphy reports build failures as PolygraphyException
        raise CorpError(f"TensorRT could not build an engine from {Path(onnx_path).name}: {exc}") from None
    Path(engine_path).write_bytes(bytes(engine))
    return EngineBuild(build_s=round(time.perf_counter() - start, 2), device=torch.cuda.get_device_name())


class TensorRTRunner(Runner):
    """A serialized engine on the GPU (Polygraphy's ``TrtRunner``, activated on construction and
    deactivated by ``close``)."""

    name = "tensorrt"

    def __init__(self, engine_path: str | Path) -> None:
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner  # with TensorRT only: loaded to run an engine

        self._runner = TrtRunner(EngineFromBytes(Path(engine_path).read_bytes()))
        self._runner.activate()

    def _infer(self, images: np.ndarray) -> np.ndarray:
        outputs = self._runner.infer({INPUT_NAME: images})
        return np.array(outputs[OUTPUT_NAME], copy=True)  # the runner reuses its host buffers

    def _release(self) -> None:
        self._runner.deactivate()


def build_script(
    onnx_files: list[str],
    checksums: dict[str, str],
    *,
    batch: BatchProfile,
    image_shape: tuple[int, ...],
    precision: Precision,
    workspace_gb: float | None = None,
    timing_cache: str | Path | None = None,
) -> str:
    """A bash script that builds ``<name>.engine`` from each ``<name>.onnx`` with ``trtexec``:
    the same profile, workspace, timing cache and strongly typed precision as
    :func:`build_engine` (the header says what ``precision``'s record notes for TensorRT). It first
    checks every file of ``checksums`` (name -> SHA-256: the graphs and their external weights)
    and refuses to build from a file that changed.

    User-given values (the timing cache path) appear once, as a single-quoted variable
    assignment, and nowhere in comments: no value can break out into a command."""
    dims = "x".join(str(d) for d in image_shape)
    sizes = dict(zip(("min", "opt", "max"), (batch.min, batch.opt, batch.max)))
    trtexec = [f"--{kind}Shapes={INPUT_NAME}:{b}x{dims}" for kind, b in sizes.items()]
    polygraphy = [
        f"--trt-{kind}-shapes {INPUT_NAME}:[{b},{','.join(map(str, image_shape))}]" for kind, b in sizes.items()
    ]
    if workspace_gb:
        trtexec.append(f"--memPoolSize=workspace:{int(workspace_gb * 1024)}M")
        polygraphy.append(f"--pool-limit workspace:{int(workspace_gb * 1024)}M")
    cache = shlex.quote(str(Path(timing_cache).resolve())) if timing_cache else "''"
    if timing_cache:
        polygraphy.append('--load-timing-cache "$TIMING_CACHE" --save-timing-cache "$TIMING_CACHE"')
    verifications = "\n".join(f"verify {shlex.quote(name)} {digest}" for name, digest in sorted(checksums.items()))
    builds = "\n".join(
        f"build {shlex.quote(name)} {shlex.quote(Path(name).with_suffix('.engine').name)}" for name in onnx_files
    )
    note = "".join(f"\n#   {line}" for line in precision.tensorrt_note)
    return f"""#!/usr/bin/env bash
# Build the TensorRT engine(s) of this export on the machine that will run them: an engine
# is specific to its GPU model and TensorRT version. Written by corp-deploy export.
#   input {INPUT_NAME}: batch profile MIN:OPT:MAX = {batch} of {dims} images
#   precision {precision.name}: taken from the ONNX graph (strongly typed build), TF32 off{note}
# Usage: bash {SCRIPT_NAME}     (trtexec from TensorRT >= 10 on PATH, or TRTEXEC=/path/to/trtexec)
# The same build with Polygraphy instead, per file (TIMING_CACHE as set below):
#   polygraphy convert model.onnx --convert-to trt -o model.engine --strongly-typed {" ".join(polygraphy)}
set -euo pipefail
cd "$(dirname "$0")"
TIMING_CACHE={cache}
verify() {{  # the file as corp-deploy export wrote it, or no build
  local got
  if command -v sha256sum >/dev/null; then got="$(sha256sum "$1" | cut -d' ' -f1)"; else got="$(shasum -a 256 "$1" | cut -d' ' -f1)"; fi
  if [ "$got" != "$2" ]; then
    echo "$1 does not match the SHA-256 that corp-deploy export recorded (changed or corrupted): export again" >&2
    exit 1
  fi
}}
{verifications}
TRTEXEC="${{TRTEXEC:-$(command -v trtexec || true)}}"
if [ -z "$TRTEXEC" ] && [ -x /usr/src/tensorrt/bin/trtexec ]; then TRTEXEC=/usr/src/tensorrt/bin/trtexec; fi
if [ -z "$TRTEXEC" ]; then
  echo "trtexec not found: install TensorRT >= 10 (or use corp-deploy's Docker image), or set TRTEXEC=/path/to/trtexec" >&2
  exit 127
fi
help="$("$TRTEXEC" --help 2>&1 || true)"
flags=({" ".join(trtexec)})
if [ -n "$TIMING_CACHE" ]; then flags+=("--timingCacheFile=$TIMING_CACHE"); fi
# TensorRT 10 takes the precision from the graph only with --stronglyTyped; TensorRT 11 always does.
if grep -q -- "--stronglyTyped" <<<"$help"; then flags+=(--stronglyTyped); fi
if grep -q -- "--noTF32" <<<"$help"; then flags+=(--noTF32); fi
build() {{
  echo "building $2 from $1 ..."
  "$TRTEXEC" --onnx="$1" --saveEngine="$2" "${{flags[@]}}"
}}
{builds}
echo "done: engines are in $(pwd)"
"""  # noqa: E501 (two shell lines are longer, kept as users have them)
