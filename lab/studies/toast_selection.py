"""ToaSt's FFN token channel selection: one static selection per model, or one per input?

    python -m lab.studies.toast_selection --out lab/results/toast_selection.json

docs/method.md §5 scores FFN hidden channels from a 2-20% sample of tokens, weighted toward the
class token. That can be read two ways, and this script measures both on the real DINOv2
ViT-S/14 (FFN pruned only, attention dense):

* **static** (what ``corp-deploy compress --method toast`` does): scores averaged over the
  calibration images pick one channel set per layer; the result is a plain smaller model.
* **per-input**: every image scores the channels from its own class token and sampled
  tokens at inference, keeps its own top ``k`` and runs fc1/fc2 on weights gathered for it
  (:class:`PerInputFFNBlock`, exported to ONNX as TopK + Gather + batched MatMul). The token
  sample is a fixed seeded set of patch positions, so the graph is deterministic.

Reported: held-out feature cosine to the dense model for both at several sparsities, and
ONNX Runtime CPU latency of dense, static and per-input at one sparsity, timed interleaved.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from benchmarks.latency import interleaved, speedup, summarize
from corp_deploy import CompressConfig, compress, kept_count
from corp_deploy.blocks import project_qk
from corp_deploy.methods.toast import TokenChannelImportance, class_token_attention
from exporters.onnx_export import export_onnx
from exporters.runners import OnnxRuntimeRunner
from lab.held_out import dinov2_study_setup, feature_cosine, write_dinov2_study


class PerInputFFNBlock(nn.Module):
    """A timm ``Block`` whose FFN keeps, per image, the ``kept`` channels with the highest
    ToaSt importance computed from that image's class token and ``sample`` patch positions.

    Input and output ``(B, N, C)``. Extra work over a static block of the same width: fc1 on
    ``1 + len(sample)`` tokens at full width, the class token's attention row, a TopK, and
    gathering ``2 * kept * C`` weights per image.
    """

    def __init__(self, block: nn.Module, kept: int, sample: torch.Tensor) -> None:
        super().__init__()
        self.block, self.kept = block, kept
        self.register_buffer("sample", sample)
        self.register_buffer("probe_tokens", torch.cat([torch.zeros(1, dtype=sample.dtype), sample]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, mlp = self.block, self.block.mlp
        xn = b.norm1(x)
        weights = class_token_attention(*project_qk(b.attn, xn), b.attn.scale)[:, self.sample]  # (B, m)
        x = x + b.ls1(b.attn(xn))
        y = b.norm2(x)
        probe = mlp.act(mlp.fc1(y[:, self.probe_tokens]))  # class token + sample
        importance = TokenChannelImportance.CLASS_WEIGHT * probe[:, 0].abs() + TokenChannelImportance.SAMPLE_WEIGHT * (
            weights[..., None] * probe[:, 1:].abs()
        ).mean(1)
        top = importance.topk(self.kept, dim=1).indices  # (B, k)
        w1, b1 = mlp.fc1.weight[top], mlp.fc1.bias[top]  # (B, k, C), (B, k)
        w2 = mlp.fc2.weight.T[top]  # (B, k, C_out)
        h = mlp.act(torch.bmm(y, w1.transpose(1, 2)) + b1[:, None])
        return x + b.ls2(torch.bmm(h, w2) + mlp.fc2.bias)


def per_input_model(dense: nn.Module, sparsity: float, fraction: float, seed: int = 0) -> nn.Module:
    """A copy of ``dense`` whose every block selects its FFN channels per input."""
    model = copy.deepcopy(dense)
    patches = model.patch_embed.num_patches
    g = torch.Generator().manual_seed(seed)
    sample = torch.randperm(patches, generator=g)[: max(1, round(fraction * patches))].sort().values
    sample = sample + model.num_prefix_tokens
    model.blocks = nn.Sequential(
        *[PerInputFFNBlock(block, kept_count(block.mlp.fc1.out_features, sparsity), sample) for block in model.blocks]
    )
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calib", type=int, default=128)
    parser.add_argument("--held-out", type=int, default=64)
    parser.add_argument("--sparsities", default="0.3,0.5,0.7")
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--time-sparsity", type=float, default=0.5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-time", type=float, default=20.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    dense, transform, calib, held = dinov2_study_setup(args.calib, args.held_out)
    rows, models = [], {"dense": dense}
    for s in (float(v) for v in args.sparsities.split(",")):
        static, _ = compress(
            dense,
            calib,
            CompressConfig.from_settings(method="toast", target="mlp", s_mlp=s, token_fraction=args.fraction),
        )
        dynamic = per_input_model(dense, s, args.fraction)
        row = {
            "sparsity": s,
            "static": feature_cosine(dense, static, held),
            "per_input": feature_cosine(dense, dynamic, held),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        if s == args.time_sparsity:
            models.update(static=static, per_input=dynamic)

    with tempfile.TemporaryDirectory() as work:
        runners = {}
        for name, model in models.items():
            export_onnx(model, Path(work) / f"{name}.onnx", (3, 224, 224))
            runners[name] = OnnxRuntimeRunner(Path(work) / f"{name}.onnx", "cpu", threads=args.threads)
        x = np.random.default_rng(0).standard_normal((args.batch, 3, 224, 224), dtype=np.float32)
        parity = float(
            np.abs(runners["per_input"].infer(x) - models["per_input"](torch.from_numpy(x)).detach().numpy()).max()
        )
        samples = interleaved({name: (lambda r=r: r.infer(x)) for name, r in runners.items()}, min_time=args.min_time)
    timing = {
        "batch": args.batch,
        "sparsity": args.time_sparsity,
        "onnx_per_input_max_abs_vs_torch": parity,
        **{name: summarize(t, args.batch) for name, t in samples.items()},
        "speedup_static": speedup(samples["dense"], samples["static"]),
        "speedup_per_input": speedup(samples["dense"], samples["per_input"]),
        "per_input_over_static": speedup(samples["per_input"], samples["static"]),
    }
    print(json.dumps(timing), flush=True)
    write_dinov2_study(
        args.out,
        f"python -m lab.studies.toast_selection --calib {args.calib} --held-out "
        f"{args.held_out} --sparsities {args.sparsities} --fraction {args.fraction} "
        f"--time-sparsity {args.time_sparsity} --batch {args.batch} --threads {args.threads} "
        f"--min-time {args.min_time} --out {args.out}",
        "; FFN pruned only",
        fidelity=rows,
        onnxruntime_cpu=timing,
    )


if __name__ == "__main__":
    main()
