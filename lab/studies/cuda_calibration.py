"""Calibration on a CUDA GPU against the same calibration on the CPU.

    python -m lab.studies.cuda_calibration --model deit_small --images 64 \
        --out lab/results/cuda_calibration_deit_small.json

Compresses one model (seeded random weights; the comparison does not depend on them) from the
same built-in calibration photos with ``device="cpu"`` and ``device="cuda"``, uniform (joint
sparsity --s) and to a MAC budget (--macs), and records per setting: the compress time on each
device, whether both kept the same dims, the largest weight difference relative to the weight's
own largest entry (and which tensor it is in), and on held-out inputs (evaluated on the CPU in
float64, so that the evaluation adds no rounding of its own) the cosine of the two compressed
models' outputs to each other and each one's cosine to the dense model. Also records whether
TF32 was allowed for matrix products and cuDNN convolutions (the patch embedding is a
convolution), since that sets how far the two devices can agree. One untimed compress on the GPU
first takes CUDA's start-up out of the times; ``cuda_peak_memory_mb`` is the GPU run's report
(its ``process_rss_peak`` is the whole process's, the CPU runs included).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from pathlib import Path

import torch

from corp_deploy import CalibrationImages, CompressConfig, compress, create_base_model, model_transform
from corp_deploy.documents import library_versions
from corp_deploy.metrics import tensor_cosine


def timed_compress(model, batches, config):
    if config.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    compressed, report = compress(model, batches, config)
    return compressed, report, round(time.perf_counter() - start, 2)


def outputs(model, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return copy.deepcopy(model).double()(images.double()).flatten(1)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(tensor_cosine(a, b).mean().item(), 8)


def compare(cpu_model, cuda_model, dense_out, images) -> dict:
    cpu_params, cuda_params = dict(cpu_model.named_parameters()), dict(cuda_model.named_parameters())
    same_shapes = cpu_params.keys() == cuda_params.keys() and all(
        cpu_params[k].shape == cuda_params[k].shape for k in cpu_params
    )
    out = {"same_dims": same_shapes}
    if same_shapes:
        diffs = {
            k: ((cpu_params[k] - cuda_params[k]).abs().max() / cpu_params[k].abs().max().clamp_min(1e-30)).item()
            for k in cpu_params
        }
        worst = max(diffs, key=diffs.get)
        out.update(max_weight_diff_rel=diffs[worst], max_weight_diff_tensor=worst)
    cpu_out, cuda_out = outputs(cpu_model, images), outputs(cuda_model, images)
    out.update(
        cosine_cpu_vs_cuda=cosine(cpu_out, cuda_out),
        cosine_cpu_to_dense=cosine(cpu_out, dense_out),
        cosine_cuda_to_dense=cosine(cuda_out, dense_out),
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deit_small")
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--s", type=float, default=0.5)
    parser.add_argument("--macs", type=float, default=0.6)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this study needs a CUDA GPU")

    torch.manual_seed(0)
    model = create_base_model(args.model, pretrained=False).eval()
    transform, _ = model_transform(model)
    batches = list(CalibrationImages.from_builtin(transform, count=args.images, batch_size=32))
    held_out = torch.randn(16, *batches[0].shape[1:], generator=torch.Generator().manual_seed(1))
    dense_out = outputs(model, held_out)
    settings = {"uniform": dict(s_mlp=args.s, s_attn=args.s), "budget": dict(macs=args.macs)}
    # untimed: CUDA's start-up (context, kernels, solver handles)
    compress(model, batches[:1], CompressConfig.from_settings(**settings["uniform"], device="cuda"))
    rows = {}
    for name, setting in settings.items():
        cpu_model, cpu_report, cpu_s = timed_compress(model, batches, CompressConfig.from_settings(**setting))
        cuda_model, cuda_report, cuda_s = timed_compress(
            model, batches, CompressConfig.from_settings(**setting, device="cuda")
        )
        rows[name] = {
            "setting": setting,
            "compress_s": {"cpu": cpu_s, "cuda": cuda_s},
            "phases_s": {"cpu": cpu_report["time_s"], "cuda": cuda_report["time_s"]},
            "macs": {
                "cpu": cpu_report["macs"]["compressed"],
                "cuda": cuda_report["macs"]["compressed"],
                "dense": cpu_report["macs"]["dense"],
            },
            "cuda_peak_memory_mb": cuda_report["peak_memory_mb"],
            **compare(cpu_model, cuda_model, dense_out, held_out),
        }
        print(json.dumps({name: rows[name]}), flush=True)
    result = {
        "command": f"python -m lab.studies.cuda_calibration --model {args.model} --images {args.images} "
        f"--s {args.s} --macs {args.macs} --out {args.out}",
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(),
        },
        "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32},
        "versions": library_versions(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
