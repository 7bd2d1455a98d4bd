"""Proof that a redesign leaves the artifacts unchanged: SHA-256 of ``model.safetensors`` (and of
``config.json`` without its creation time) for every small test model and every method, recorded
before the redesign and checked after it, on the same machine.

    python -m lab.unchanged_artifacts --record lab/results/unchanged_artifacts.json
    python -m lab.unchanged_artifacts --check lab/results/unchanged_artifacts.json

Each case builds a small timm model with seeded random weights and compresses it on seeded
random images through the library API (every family, each method that applies to it: uniform
sparsity, a MAC budget, sequential calibration, no compensation), or runs ``corp-deploy
compress`` on a small ViT with the built-in photos (each method, a budget, option spellings the
CLI maps onto the config). Bit-identical weights are expected only on one machine with the same
libraries: another CPU can pick other kernels, so the recorded file names its machine and
library versions, and ``--check`` refuses a record from elsewhere. Not a test for that reason.
The case list is written out here, not imported from tests, so that it cannot move with the
code it checks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import timm
import torch

from corp_deploy import CompressConfig, compress, save_artifact
from corp_deploy.documents import library_versions

SMALL = dict(depth=2, embed_dim=192, num_heads=3, num_classes=10)

#: name: (timm model, creation arguments, image size, target that prunes every part the family
#: allows (None: the method's default), methods that apply)
FAMILIES = {
    "vit": (
        "vit_tiny_patch16_224",
        dict(img_size=32, patch_size=8, depth=2, num_classes=10),
        32,
        None,
        ("corp", "vbp", "toast"),
    ),
    "hybrid-cnn-stem": (
        "vit_tiny_r_s16_p8_224",
        dict(img_size=64, depth=2, num_classes=10),
        64,
        None,
        ("corp", "vbp", "toast"),
    ),
    "vit-swiglu": (
        "vit_giant_patch14_dinov2",
        dict(img_size=28, patch_size=7, **SMALL),
        28,
        None,
        ("corp", "vbp", "toast"),
    ),
    "relpos": (
        "vit_relpos_small_patch16_224",
        dict(img_size=32, patch_size=8, depth=2, num_classes=10),
        32,
        None,
        ("corp", "vbp", "toast"),
    ),
    "beit": ("beit_base_patch16_224", dict(img_size=32, patch_size=8, **SMALL), 32, None, ("corp", "vbp", "toast")),
    "eva02": (
        "eva02_tiny_patch14_224",
        dict(img_size=28, patch_size=7, depth=2, num_classes=10),
        28,
        "mlp-vo",
        ("corp", "vbp", "toast"),
    ),
    "dinov3": (
        "vit_small_patch16_dinov3",
        dict(img_size=32, patch_size=8, dynamic_img_size=False, **SMALL),
        32,
        "mlp-vo",
        ("corp", "vbp", "toast"),
    ),
    "eva02-sub-ln": ("eva02_base_patch14_224", dict(img_size=28, patch_size=7, **SMALL), 28, "vo", ("corp",)),
    "eva-clip": (
        "eva_giant_patch14_224",
        dict(img_size=28, patch_size=7, mlp_ratio=4.0, **SMALL),
        28,
        None,
        ("corp", "vbp", "toast"),
    ),
    "cait": ("cait_xxs24_224", dict(img_size=32, patch_size=8, depth=2, num_classes=10), 32, "mlp", ("corp", "vbp")),
    "swin": (
        "swin_tiny_patch4_window7_224",
        dict(img_size=56, embed_dim=32, depths=(2, 2), num_heads=(2, 4), num_classes=10),
        56,
        None,
        ("corp", "vbp"),
    ),
}

#: ``corp-deploy compress`` runs on one small ViT (random weights, built-in photos).
CLI_MODEL = [
    "vit_tiny_patch16_224",
    "--no-pretrained",
    "--model-arg",
    "img_size=64",
    "--model-arg",
    "depth=2",
    "--calib-samples",
    "16",
    "--batch-size",
    "8",
]
CLI_CASES = {
    "corp-s0.5": [],
    "corp-all-s0.3-round8": ["--target", "all", "--s", "0.3", "--round-to", "8"],
    "corp-mlp-vo-split": ["--target", "mlp-vo", "--s-mlp", "0.4", "--s-vo", "0.25", "--ranker", "energy"],
    "corp-macs0.7": ["--macs", "0.7"],
    "corp-speedup1.5-equal": ["--speedup", "1.5", "--equal-head-dims", "--unit-floor", "0.2"],
    "corp-sequential-ridge": ["--s", "0.4", "--calibration", "sequential", "--ridge", "0.01"],
    "corp-no-compensation": ["--s", "0.5", "--no-compensation"],
    "vbp-s0.3": ["--method", "vbp", "--s", "0.3", "--layer-floor", "0.2"],
    "toast": ["--method", "toast", "--s-mlp", "0.5", "--s-attn", "0.25", "--token-fraction", "0.2"],
}


def dense_model(family: str) -> torch.nn.Module:
    """The family's small model, seeded; constant-initialised tables, biases and scales drawn too."""
    name, kwargs = FAMILIES[family][:2]
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, **kwargs).eval()
    with torch.no_grad():
        for key, parameter in model.named_parameters():
            if key.endswith(("relative_position_bias_table", "q_bias", "v_bias", "gamma_1", "gamma_2")):
                parameter.normal_(0.0, 0.5)
    return model


def api_configs(family: str) -> dict[str, CompressConfig]:
    target, methods = FAMILIES[family][3], FAMILIES[family][4]
    sparsities = dict(sparsity=0.5)  # every part the target prunes (a part it leaves whole records 0)
    configs = {
        "corp-s0.5": CompressConfig.from_settings(target=target, **sparsities),
        "corp-macs0.9": CompressConfig.from_settings(macs=0.9, target=target),
        "corp-sequential": CompressConfig.from_settings(target=target, calibration="sequential", **sparsities),
        "corp-no-compensation": CompressConfig.from_settings(target=target, compensation=False, **sparsities),
    }
    if "vbp" in methods:
        configs["vbp-s0.5"] = CompressConfig(method="vbp", s_mlp=0.5)
    if "toast" in methods:
        toast_target = "mlp" if target is not None else None
        configs["toast-s0.5"] = CompressConfig(method="toast", sparsity=0.5, target=toast_target)
    return configs


def artifact_hashes(folder: Path) -> dict[str, str]:
    """SHA-256 of the weights, and of config.json without its creation time and library versions."""
    config = json.loads((folder / "config.json").read_text())
    config.pop("created", None)
    config.pop("versions", None)
    return {
        "model.safetensors": hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest(),
        "config.json": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
    }


def all_hashes(work: Path) -> dict[str, dict[str, str]]:
    hashes = {}
    for family in FAMILIES:
        name, kwargs, size = FAMILIES[family][:3]
        for case, config in api_configs(family).items():
            generator = torch.Generator().manual_seed(1)
            images = [torch.randn(8, 3, size, size, generator=generator) for _ in range(2)]
            model, report = compress(dense_model(family), images, config)
            folder = save_artifact(
                model,
                work / f"{family}-{case}",
                plots=False,
                report=report,
                # no weights record: the tables dense_model redraws after seeding rebuild from none
                base_model={"name": name, "model_kwargs": kwargs},
                settings=config.to_dict(),
            )
            hashes[f"api/{family}/{case}"] = artifact_hashes(folder)
            print(f"api/{family}/{case}", flush=True)
    for case, args in CLI_CASES.items():
        out = work / f"cli-{case}"
        subprocess.run(
            [sys.executable, "-m", "corp_deploy.launch", "compress", *CLI_MODEL, *args, "-o", str(out)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "CORP_DEPLOY_STATE_DIR": str(work / "state"), "OMP_NUM_THREADS": "1"},
        )
        hashes[f"cli/{case}"] = artifact_hashes(out)
        print(f"cli/{case}", flush=True)
    return hashes


#: What of :func:`machine` must match for two runs' hashes to be comparable: the processor (its
#: kernels) and the libraries; not the operating system's build string (one VM image to the next).
COMPARABLE = ("cpu", "versions")


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo")
    names = (
        [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        if cpuinfo.exists()
        else []
    )
    return {
        "cpu": names[0] if names else platform.machine(),
        "platform": platform.platform(),
        "versions": library_versions(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", type=Path, help="write the hashes to this JSON file")
    mode.add_argument("--check", type=Path, help="compare with the hashes in this JSON file")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one reduction order for every run
    with tempfile.TemporaryDirectory() as work:
        hashes = all_hashes(Path(work))
    if args.record:
        args.record.write_text(
            json.dumps(
                {
                    "command": " ".join(["python -m", __spec__.name, *sys.argv[1:]]),
                    "machine": machine(),
                    "hashes": hashes,
                },
                indent=1,
            )
            + "\n"
        )
        print(f"recorded {len(hashes)} artifacts in {args.record}")
        return
    recorded = json.loads(args.check.read_text())
    here = machine()
    if any(recorded["machine"][key] != here[key] for key in COMPARABLE):  # the kernel's build string may differ
        sys.exit(f"{args.check} was recorded on another machine or with other libraries: {recorded['machine']}")
    changed = sorted(case for case in recorded["hashes"] if hashes.get(case) != recorded["hashes"][case])
    missing = sorted(set(recorded["hashes"]) - set(hashes))
    for case in changed:
        print(f"CHANGED {case}: {hashes.get(case)} != {recorded['hashes'][case]}")
    if changed or missing:
        sys.exit(f"{len(changed)} of {len(recorded['hashes'])} artifacts differ")
    print(f"all {len(hashes)} artifacts bit-identical")


if __name__ == "__main__":
    main()
