"""What the int8 studies share: their command line and the graphs, model and images they load.

An int8 study reads an artifact's ``export-fp32/`` (made with ``--dense`` for ``--graph dense``),
calibrates on seeded crops of the built-in calibration photos and evaluates on crops of the
held-out photos, against the float32 PyTorch model of the same graph.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from torch import nn

from corp_deploy import CalibrationImages, load_base_model, load_compressed, model_transform
from corp_deploy.metrics import as_rows, cosine
from exporters.manifest import read_manifest
from exporters.pipeline import parity_images


def int8_study_parser(description: str, graph: str = "dense") -> argparse.ArgumentParser:
    """The arguments every int8 study takes (``graph``: the default of ``--graph``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--graph", choices=("dense", "model"), default=graph)
    parser.add_argument("--calib", type=int, default=128, help="calibration crops")
    parser.add_argument("--images", type=int, default=64, help="held-out crops")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-time", type=float, default=10.0)
    parser.add_argument("--out", type=Path, required=True)
    return parser


def load_int8_study(args: argparse.Namespace) -> tuple[Path, nn.Module, list[torch.Tensor], np.ndarray]:
    """``(fp32 graph path, its PyTorch model in eval mode, calibration batches (B, C, H, W),
    held-out images (args.images, C, H, W) float32)``."""
    export = args.artifact / "export-fp32"
    fp32 = export / read_manifest(export).models[args.graph].onnx[0]
    model = (load_base_model if args.graph == "dense" else load_compressed)(args.artifact).eval()
    transform, _ = model_transform(model)
    calibration = list(CalibrationImages.from_builtin(transform, count=args.calib, batch_size=32))
    return fp32, model, calibration, parity_images(model, args.images, held_out=True)


def cosines(reference: np.ndarray, outputs: np.ndarray) -> np.ndarray:
    """Per-image cosine of ``outputs`` to ``reference``, both ``(images, features)``, in float64."""
    return cosine(as_rows(reference), as_rows(outputs))
