"""Dense against compressed in half precision: latency, speedup, share of the MAC-ideal, and which
attention kernel PyTorch ran for each model (issue 46).

    python -m lab.studies.half_precision --model deit_base_patch16_224 --device cuda \\
        --precisions fp32,fp16,bf16 --batches 1,8,64 --out lab/results/half_precision_deit_base.json

Seeded random weights (speed and kernel choice do not depend on them), compressed on ``--device``
from the built-in photos. The compressed variants, each a lever on the attention's head dims:

- ``s0.5``: uniform s = 0.5 (query/key heads pruned, value heads kept: unequal head dims),
- ``s0.5-equal``: ``--target all --equal-head-dims`` (value heads pruned to the query/key dims),
- ``s0.5-qk-padded``: ``s0.5`` with zero query/key dims appended up to the value dims (exact: a
  zero dim adds nothing to a logit), the MLP and value savings kept,
- ``s0.45`` and ``s0.45-round8``: query/key dims that are not a multiple of 8 (35 of 64), and the
  same rounded with ``--round-to 8``.

For each precision and batch size every model is timed interleaved in one loop (the images on the
device already, the GPU waited for after each call; no host copies), with the attention kernels
PyTorch picked by default (:func:`benchmarks.attention_kernels.attention_kernels`); at the largest
batch each model is also timed with each SDPA backend forced in turn (a backend that refuses the
inputs is recorded with its reason). Parity: the cosine of each model's outputs in that precision
to its float32 outputs on the same device, on 8 images (worst image).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import warnings
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.attention_kernels import attention_kernels, kernel_summary
from benchmarks.latency import interleaved, speedup, summarize
from corp_deploy import CalibrationImages, CompressConfig, compress, count_macs, create_base_model, model_transform
from corp_deploy.documents import library_versions
from corp_deploy.files import write_json
from corp_deploy.layers import PrunedAttention
from corp_deploy.metrics import tensor_cosine
from exporters.runners import TORCH_PRECISIONS

#: The compressed variants: CompressConfig settings, and whether the query/key dims are padded after.
VARIANTS = {
    "s0.5": ({"sparsity": 0.5}, False),
    "s0.5-equal": ({"sparsity": 0.5, "target": "all", "equal_head_dims": True}, False),
    "s0.5-qk-padded": ({"sparsity": 0.5}, True),
    "s0.45": ({"sparsity": 0.45}, False),
    "s0.45-round8": ({"sparsity": 0.45, "round_to": 8}, False),
}
FORCED = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def pad_query_key(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose :class:`PrunedAttention` layers have zero query/key dims appended
    up to their value head dims (same function: each logit gains zero terms)."""
    model = copy.deepcopy(model)
    for block in model.blocks:
        attn = block.attn
        if not isinstance(attn, PrunedAttention) or attn.qk_head_dim >= attn.v_head_dim:
            continue
        H, dqk, dv = attn.num_heads, attn.qk_head_dim, attn.v_head_dim
        padded = PrunedAttention.replacing(attn, dv, dv)
        with torch.no_grad():
            w, b = attn.qkv.weight, attn.qkv.bias
            new_w, new_b = padded.qkv.weight, padded.qkv.bias
            new_w.zero_()
            if new_b is not None:
                new_b.zero_()
            for part in range(2):  # q, k: head h's first dqk dims are the old ones
                for h in range(H):
                    rows_old = slice(part * H * dqk + h * dqk, part * H * dqk + (h + 1) * dqk)
                    rows_new = slice(part * H * dv + h * dv, part * H * dv + h * dv + dqk)
                    new_w[rows_new] = w[rows_old]
                    if b is not None:
                        new_b[rows_new] = b[rows_old]
            new_w[2 * H * dv :] = w[2 * H * dqk :]
            if b is not None:
                new_b[2 * H * dv :] = b[2 * H * dqk :]
            padded.proj.load_state_dict(attn.proj.state_dict())
        block.attn = padded
    return model


def head_dims(model: torch.nn.Module) -> dict:
    """The first block's query/key and value head dims, and whether every block has the same."""
    dims = [
        (b.attn.qk_head_dim, b.attn.v_head_dim) if isinstance(b.attn, PrunedAttention) else (None, None)
        for b in model.blocks
    ]
    return {"qk": dims[0][0], "v": dims[0][1], "uniform": len(set(dims)) == 1}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_models(models: dict, x: torch.Tensor, min_time: float, warmup: int = 3) -> dict[str, list[float]]:
    def call(model):
        def run():
            model(x)
            synchronize(x.device)

        return run

    with torch.no_grad():
        return interleaved({name: call(m) for name, m in models.items()}, warmup=warmup, min_time=min_time)


def forced_backend(model: torch.nn.Module, x: torch.Tensor, backend: SDPBackend, min_time: float) -> dict:
    """``model(x)`` with only ``backend`` allowed: its p50 milliseconds, or why the backend refused
    (PyTorch's warnings say why each kernel cannot run; its error only that none could)."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel([backend]):
                samples = time_models({"m": model}, x, min_time, warmup=2)["m"]
        except RuntimeError as exc:
            reasons = dict.fromkeys(str(w.message).strip().splitlines()[0][:300] for w in said)
            return {"refused": str(exc).strip().splitlines()[0][:300], "why": list(reasons)}
    return {"p50_ms": round(summarize(samples, len(x))["p50_s"] * 1e3, 4)}


def cosine_to_fp32(model32: torch.nn.Module, model: torch.nn.Module, x32: torch.Tensor, dtype) -> float:
    with torch.no_grad():
        a, b = model32(x32).double(), model(x32.to(dtype)).double()
    return float(tensor_cosine(a.flatten(1), b.flatten(1)).min())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deit_base_patch16_224")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precisions", default="fp32,fp16,bf16")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--images", type=int, default=64, help="calibration images")
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds each model is timed per cell")
    parser.add_argument("--forced-min-time", type=float, default=0.3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    dense = create_base_model(args.model, pretrained=False, seed=0).to(device)
    image_shape = (3, *dense.patch_embed.img_size)
    images = CalibrationImages.from_builtin(model_transform(dense)[0], count=args.images, batch_size=32)
    models, variants = {"dense": dense}, {}
    dense_macs = count_macs(dense, image_shape)
    for name in args.variants.split(","):
        settings, padded = VARIANTS[name]
        compressed, _ = compress(dense, images, CompressConfig.from_settings(device=args.device, **settings))
        compressed = compressed.to(device)  # compress returns its model on the CPU
        models[name] = pad_query_key(compressed) if padded else compressed
        macs = count_macs(models[name], image_shape)
        variants[name] = {"settings": settings, "qk_padded": padded, "head_dims": head_dims(models[name])}
        if padded:  # the padding is exact: the padded model's outputs are the unpadded one's
            probe = torch.randn(4, *image_shape, device=device, generator=torch.Generator(device).manual_seed(3))
            variants[name]["cosine_to_unpadded"] = round(
                cosine_to_fp32(compressed, models[name], probe, torch.float32), 9
            )
        variants[name] |= {"gmacs": round(macs / 1e9, 4), "ideal_speedup": round(dense_macs / macs, 4)}
        print(name, json.dumps(variants[name]), flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    x32 = torch.randn(8, *image_shape, device=device, generator=torch.Generator(device).manual_seed(1))
    result = {
        "command": "python -m lab.studies.half_precision " + " ".join(sys.argv[1:]),
        "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "versions": library_versions(),
        "dense_gmacs": round(dense_macs / 1e9, 4),
        "variants": variants,
        "cells": [],
    }
    for precision in args.precisions.split(","):
        dtype = TORCH_PRECISIONS[precision]
        cast = {name: copy.deepcopy(m).eval().to(device, dtype) for name, m in models.items()}
        parity = {
            name: round(cosine_to_fp32(models[name].eval(), m, x32, dtype), 7) if precision != "fp32" else 1.0
            for name, m in cast.items()
        }
        for batch in batches:
            x = torch.randn(batch, *image_shape, device=device, generator=torch.Generator(device).manual_seed(2))
            x = x.to(dtype)
            kernels = {name: kernel_summary(attention_kernels(m, x)) for name, m in cast.items()}
            samples = time_models(cast, x, args.min_time)
            cell = {"precision": precision, "batch": batch, "models": {}}
            for name in cast:
                timing = summarize(samples[name], batch)
                entry = {"p50_ms": round(timing["p50_s"] * 1e3, 4), "kernels": kernels[name], "parity": parity[name]}
                if name != "dense":
                    ratio = speedup(samples["dense"], samples[name])["median"]
                    ideal = variants[name]["ideal_speedup"]
                    entry |= {"speedup": round(ratio, 4), "of_ideal": round(ratio / ideal, 4)}
                if batch == max(batches) and precision != "fp32":
                    entry["forced"] = {
                        kernel: forced_backend(cast[name], x, backend, args.forced_min_time)
                        for kernel, backend in FORCED.items()
                    }
                cell["models"][name] = entry
            result["cells"].append(cell)
            print(json.dumps(cell), flush=True)
            write_json(args.out, result)  # after every cell: a run stopped at its time limit keeps what it measured
        del cast
    write_json(args.out, result)


if __name__ == "__main__":
    main()
