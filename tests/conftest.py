"""Shared fixtures: small random-weight timm ViTs and calibration batches, and a fixed seed
for every test."""
from __future__ import annotations

import random

import numpy as np
import pytest
import timm
import torch

# A DeiT-shaped ViT small enough for exact linear algebra in tests:
# 32 px / patch 8 -> 16 patches + class token, width 48, 3 heads of 16 dims, MLP 192.
SMALL_VIT_KWARGS = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3)
#: The same model as ``corp-deploy compress deit_tiny`` arguments.
SMALL_VIT_CLI_ARGS = [arg for key, value in SMALL_VIT_KWARGS.items() for arg in ("--model-arg", f"{key}={value}")]


def small_vit(seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False,
                              **{**SMALL_VIT_KWARGS, **overrides})
    # Random init gives near-zero biases; give them scale so bias handling is exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    return model.eval()


def run_cli(args, state_dir):
    """Run ``corp-deploy ARGS`` in-process, remembering the latest artifact under ``state_dir``.

    Returns ``(result, everything it printed)``.
    """
    from click.testing import CliRunner

    from corp_deploy.cli import cli
    result = CliRunner().invoke(cli, [str(a) for a in args], env={"CORP_DEPLOY_STATE_DIR": str(state_dir)})
    return result, result.output + (result.stderr if hasattr(result, "stderr") else "")


def image_batches(n_batches: int, batch: int, size: int = 32, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 3, size, size, generator=g) for _ in range(n_batches)]


#: Tolerances for values computed in float32 and compared in float64 (float32's resolution,
#: with headroom for sums of a few hundred terms).
FLOAT32 = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def _seed_every_random_draw():
    """Every test starts from the same torch, NumPy and ``random`` state, whatever ran before it
    (so a test that draws without its own generator is still reproducible in any order)."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)


@pytest.fixture
def vit():
    return small_vit()


@pytest.fixture
def batches():
    return image_batches(3, 8)
