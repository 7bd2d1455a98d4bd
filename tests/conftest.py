"""Shared fixtures: small random-weight timm ViTs and calibration batches, the command line run
in-process, one small compressed artifact (built once per session), and a fixed seed for every
test. Values needed where a fixture cannot be requested are in ``tests/helpers.py``."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import SMALL_VIT_CLI_ARGS, build_small_vit


@pytest.fixture(autouse=True)
def _seed_every_random_draw():
    """Every test starts from the same torch, NumPy and ``random`` state, whatever ran before it
    (so a test that draws without its own generator is still reproducible in any order)."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)


@pytest.fixture(scope="session")
def small_vit():
    """``small_vit(seed=0, **overrides)``: the small ViT of ``tests/helpers.py`` with random weights
    (biases drawn too) from ``seed``, in eval mode."""
    return build_small_vit


@pytest.fixture(scope="session")
def image_batches():
    """``image_batches(n_batches, batch, size=32, seed=1)``: batches of random images
    ``(batch, 3, size, size)`` drawn from their own generator."""

    def batches(n_batches: int, batch: int, size: int = 32, seed: int = 1) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(batch, 3, size, size, generator=g) for _ in range(n_batches)]

    return batches


@pytest.fixture(scope="session")
def run_cli():
    """``run_cli(args, state_dir)``: ``corp-deploy ARGS`` run in-process, remembering the latest
    artifact under ``state_dir``; returns ``(result, everything it printed)``."""
    from click.testing import CliRunner

    from corp_deploy.cli import cli

    def run(args, state_dir):
        result = CliRunner().invoke(cli, [str(a) for a in args], env={"CORP_DEPLOY_STATE_DIR": str(state_dir)})
        return result, result.output + (result.stderr if hasattr(result, "stderr") else "")

    return run


@pytest.fixture
def vit(small_vit):
    return small_vit()


@pytest.fixture
def batches(image_batches):
    return image_batches(3, 8)


def _compress_tiny(run_cli, root: Path, seed: int) -> Path:
    """``corp-deploy compress`` of the small ViT with random weights from ``seed``, on 16 built-in
    photos, at sparsity 0.5, into ``root/art``."""
    result, text = run_cli(
        [
            "compress",
            "deit_tiny",
            "--no-pretrained",
            *SMALL_VIT_CLI_ARGS,
            "--calib-samples",
            16,
            "--s",
            0.5,
            "--seed",
            seed,
            "-o",
            root / "art",
        ],
        root / "state",
    )
    assert result.exit_code == 0, text
    return root / "art"


@pytest.fixture(scope="session")
def tiny_artifact(run_cli, tmp_path_factory) -> Path:
    """The small compressed artifact (random weights, seed 0) written by ``corp-deploy compress``,
    built once and shared: tests only read it (``tiny_artifact_copy`` to change one)."""
    return _compress_tiny(run_cli, tmp_path_factory.mktemp("tiny-artifact"), seed=0)


@pytest.fixture(scope="session")
def other_tiny_artifact(run_cli, tmp_path_factory) -> Path:
    """Another artifact of the same shapes as ``tiny_artifact`` (weights from seed 1), shared:
    tests only read it."""
    return _compress_tiny(run_cli, tmp_path_factory.mktemp("other-tiny-artifact"), seed=1)


@pytest.fixture
def tiny_artifact_copy(tiny_artifact, tmp_path) -> Path:
    """A copy of ``tiny_artifact`` in the test's own folder (``tmp_path/art``), for tests that change it."""
    return shutil.copytree(tiny_artifact, tmp_path / "art")
