"""The small ViT the tests share, as plain values and one builder: what is needed where pytest's
fixtures cannot be requested (parametrisations, command lines and refusal cases written at module
level). Tests otherwise request the fixtures of ``conftest.py`` (``small_vit``, ``image_batches``,
``run_cli``, ``tiny_artifact``, ...)."""

from __future__ import annotations

import timm
import torch

# A DeiT-shaped ViT small enough for exact linear algebra in tests:
# 32 px / patch 8 -> 16 patches + class token, width 48, 3 heads of 16 dims, MLP 192.
SMALL_VIT_KWARGS = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3)
#: The same model as ``corp-deploy compress deit_tiny`` arguments.
SMALL_VIT_CLI_ARGS = [arg for key, value in SMALL_VIT_KWARGS.items() for arg in ("--model-arg", f"{key}={value}")]

#: Tolerances for values computed in float32 and compared in float64 (float32's resolution,
#: with headroom for sums of a few hundred terms).
FLOAT32 = dict(rtol=1e-5, atol=1e-6)


def build_small_vit(seed: int = 0, **overrides) -> torch.nn.Module:
    """The small ViT (``SMALL_VIT_KWARGS`` with ``overrides``) with random weights drawn from ``seed``,
    in eval mode; its biases are drawn too (timm initialises them to near zero), so that bias
    handling is exercised. Tests request it as the ``small_vit`` fixture."""
    torch.manual_seed(seed)
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, **{**SMALL_VIT_KWARGS, **overrides})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    return model.eval()


#: Python lines that start a child script a test interrupts: the signals it sends there (SIGINT,
#: SIGQUIT) at their default action, as in a shell's foreground job. A test suite started in the
#: background of a script without job control (``bash .ci/run &``, a CI runner's job) inherits SIGINT
#: and SIGQUIT ignored (POSIX), its children too, and corp-deploy keeps a signal ignored that it was
#: started ignoring (as it keeps nohup's SIGHUP): the interrupt a test sends would never arrive.
AS_A_FOREGROUND_JOB = (
    "import signal\nfor _signal in (signal.SIGINT, signal.SIGQUIT):\n    signal.signal(_signal, signal.SIG_DFL)\n"
)
