"""The drift-correcting refit (docs/method.md §10) against independent computations: the shrunk
ridge solve against lstsq on raw samples, and the refitted layers of a compressed model against
the same fit on that model's own activations."""

import pytest
import torch

from corp_deploy import CompressConfig, CorpOptions, compress
from corp_deploy.engine import embed_tokens
from corp_deploy.errors import SettingError
from corp_deploy.methods.corp.refit import solve_refit
from corp_deploy.stats import MomentAccumulator


def shrunk_ridge_lstsq(
    h: torch.Tensor, t: torch.Tensor, w0: torch.Tensor, alpha: float, gamma: torch.Tensor | None = None
):
    """``argmin_{W, b} mean||gamma * (t - W h - b)||^2 + lambda ||W - W0||^2`` with
    ``lambda = alpha mean(gamma^2) tr(Cov h) / k``, row by row as least-squares problems on raw
    samples (float64): rows ``[h, 1] -> t_o`` and ``sqrt(n lambda_o) [I, 0] -> sqrt(n lambda_o) W0_o``,
    ``lambda_o = lambda / gamma_o^2``."""
    n, k = h.shape
    g2 = torch.ones(t.shape[1], dtype=h.dtype) if gamma is None else gamma.double().square()
    lam = alpha * float(g2.mean()) * float(torch.var(h, dim=0, unbiased=False).sum()) / k
    weights, biases = [], []
    for o in range(t.shape[1]):
        root = (n * lam / float(g2[o])) ** 0.5
        design = torch.cat(
            [
                torch.cat([h, torch.ones(n, 1, dtype=h.dtype)], 1),
                torch.cat([root * torch.eye(k, dtype=h.dtype), torch.zeros(k, 1, dtype=h.dtype)], 1),
            ]
        )
        solution = torch.linalg.lstsq(design, torch.cat([t[:, o], root * w0[o]])[:, None]).solution[:, 0]
        weights.append(solution[:k])
        biases.append(solution[k])
    return torch.stack(weights), torch.stack(biases)


@pytest.mark.parametrize("alpha", [0.0, 0.1, 1.0, 10.0])
@pytest.mark.parametrize("layer_scale", [False, True])
def test_solve_refit_is_the_shrunk_ridge_fit_of_the_raw_samples(alpha, layer_scale):
    g = torch.Generator().manual_seed(0)
    n, k, out = 500, 12, 7
    h = (torch.randn(n, k, generator=g) @ torch.randn(k, k, generator=g) + 2.0).float()
    w_true = torch.randn(out, k, generator=g)
    t = (h @ w_true.T + 0.5 + 0.3 * torch.randn(n, out, generator=g)).float()
    w0 = w_true + 0.5 * torch.randn(out, k, generator=g)
    b0 = torch.randn(out, generator=g)
    gamma = torch.rand(out, generator=g) * 2 + 0.01 if layer_scale else None
    joint = MomentAccumulator(k + out, track_positive=False)
    for rows in torch.cat([h, t], 1).split(128):
        joint.update(rows)
    solution = solve_refit(joint, w0, b0, alpha, gamma)

    h64, t64 = h.double(), t.double()
    w_ref, b_ref = shrunk_ridge_lstsq(h64, t64, w0.double(), alpha, gamma)
    torch.testing.assert_close(solution.weight, w_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(solution.bias, b_ref, rtol=1e-4, atol=1e-5)
    g = torch.ones(out, dtype=torch.float64) if gamma is None else gamma.double()
    energy = (g * t64).square().sum(1).mean()
    before = (g * (t64 - h64 @ w0.double().T - b0.double())).square().sum(1).mean() / energy
    after = (g * (t64 - h64 @ w_ref.T - b_ref)).square().sum(1).mean() / energy
    assert solution.relative_error_before == pytest.approx(float(before), rel=1e-4)
    assert solution.relative_error_after == pytest.approx(float(after), rel=1e-4, abs=1e-6)  # float32 moments
    assert solution.relative_error_after <= solution.relative_error_before


def test_solve_refit_leaves_rows_that_do_not_reach_the_stream():
    g = torch.Generator().manual_seed(3)
    h, t = torch.randn(300, 5, generator=g), torch.randn(300, 4, generator=g)
    w0, b0 = torch.randn(4, 5, generator=g), torch.randn(4, generator=g)
    joint = MomentAccumulator(9, track_positive=False)
    joint.update(torch.cat([h, t], 1))
    solution = solve_refit(joint, w0, b0, 1.0, torch.tensor([1.0, 0.0, 0.5, 0.0]))
    torch.testing.assert_close(solution.weight[[1, 3]], w0[[1, 3]].double())
    torch.testing.assert_close(solution.bias[[1, 3]], b0[[1, 3]].double())
    assert not torch.allclose(solution.weight[0], w0[0].double())


def test_solve_refit_keeps_the_layer_when_it_already_fits_exactly():
    """No drift: the target is the layer's own output, so the refit returns the layer."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(400, 10, generator=g)
    w0, b0 = torch.randn(6, 10, generator=g), torch.randn(6, generator=g)
    joint = MomentAccumulator(16, track_positive=False)
    joint.update(torch.cat([h, h @ w0.T + b0], 1))
    solution = solve_refit(joint, w0, b0, alpha=1.0)
    torch.testing.assert_close(solution.weight, w0.double(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(solution.bias, b0.double(), rtol=1e-4, atol=1e-5)


def layer_scaled_vit(small_vit, depth: int = 3):
    """The small ViT with random LayerScales (so that the refit's division by gamma is exercised)."""
    model = small_vit(depth=depth, init_values=1.0)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.2)
    return model


def block_streams(model, images: list[torch.Tensor]):
    """Per block: its input, the residual after its attention and its output, and the inputs of
    its ``attn.proj`` and ``mlp.fc2``, all calibration images stacked (float64)."""
    streams = [dict(x=[], mid=[], end=[], proj_in=[], fc2_in=[]) for _ in model.blocks]
    with torch.no_grad():
        for batch in images:
            x = embed_tokens(model, batch)
            for block, s in zip(model.blocks, streams):
                s["x"].append(x)
                hooks = [
                    block.attn.proj.register_forward_pre_hook(lambda m, a, s=s: s["proj_in"].append(a[0])),
                    block.mlp.fc2.register_forward_pre_hook(lambda m, a, s=s: s["fc2_in"].append(a[0])),
                ]
                mid = x + block.ls1(block.attn(block.norm1(x)))
                x = mid + block.ls2(block.mlp(block.norm2(mid)))
                for hook in hooks:
                    hook.remove()
                s["mid"].append(mid)
                s["end"].append(x)
    return [{k: torch.cat(v).reshape(-1, v[0].shape[-1]).double() for k, v in s.items()} for s in streams]


@pytest.mark.parametrize("layers", ["proj+fc2", "fc2"])
@pytest.mark.parametrize("sizes", [dict(s_mlp=0.5, s_attn=0.5), dict(macs=0.6)], ids=["uniform", "budget"])
def test_every_refitted_layer_is_the_fit_on_the_compressed_models_own_activations(
    small_vit, image_batches, sizes, layers
):
    """Block by block: the refitted ``proj`` and ``fc2`` equal the shrunk ridge fit (lstsq on raw
    samples) from the inputs they receive in the final compressed model to the dense model's
    residual targets, shrunk toward CORP's layers (the same compression without the refit); a
    layer not refitted is CORP's."""
    dense = layer_scaled_vit(small_vit)
    images = image_batches(3, 8)
    refitted, report = compress(dense, images, CompressConfig.from_settings(**sizes, refit=layers))
    corp, _ = compress(dense, images, CompressConfig.from_settings(**sizes, refit="none"))
    dense_streams, streams = block_streams(dense, images), block_streams(refitted, images)
    for i, (block, d, c) in enumerate(zip(refitted.blocks, dense_streams, streams)):
        checked = [(block.mlp.fc2, corp.blocks[i].mlp.fc2, (d["end"] - c["mid"]), block.ls2.gamma)]
        if layers == "proj+fc2":
            checked.append((block.attn.proj, corp.blocks[i].attn.proj, (d["mid"] - c["x"]), block.ls1.gamma))
        else:
            torch.testing.assert_close(block.attn.proj.weight, corp.blocks[i].attn.proj.weight, rtol=0, atol=0)
        for layer, corp_layer, target, gamma in checked:
            inputs = c["proj_in"] if layer is block.attn.proj else c["fc2_in"]
            w_ref, b_ref = shrunk_ridge_lstsq(
                inputs, target / gamma.double(), corp_layer.weight.double(), 1.0, gamma.detach()
            )
            torch.testing.assert_close(layer.weight.double(), w_ref, rtol=1e-3, atol=2e-4, msg=f"block {i}")
            torch.testing.assert_close(layer.bias.double(), b_ref, rtol=1e-3, atol=2e-4, msg=f"block {i}")
        refit = report["layers"][i]["refit"]
        assert refit["fc2"]["relative_error_after"] <= refit["fc2"]["relative_error_before"]


def test_the_refit_leaves_an_unpruned_model_dense(small_vit, image_batches):
    """At sparsity 0 nothing drifts: the refit returns every layer as it was."""
    dense = layer_scaled_vit(small_vit)
    images = image_batches(2, 8)
    model, _ = compress(dense, images, CompressConfig.from_settings(s_mlp=0.0, s_attn=0.0, refit="proj+fc2"))
    for block, original in zip(model.blocks, dense.blocks):
        torch.testing.assert_close(block.mlp.fc2.weight, original.mlp.fc2.weight, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(block.attn.proj.weight, original.attn.proj.weight, rtol=1e-3, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(model(images[0]), dense(images[0]), rtol=1e-3, atol=1e-4)


def test_no_compensation_means_no_refit(small_vit, image_batches):
    model, report = compress(
        small_vit(), image_batches(2, 8), CompressConfig.from_settings(s_mlp=0.5, s_attn=0.5, compensation=False)
    )
    assert all("refit" not in layer for layer in report["layers"])
    assert all(block.mlp.fc2.weight.shape[1] == 96 for block in model.blocks)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(calibration="sequential", refit="fc2"), "add refit none"),
        (dict(compensation=False, refit="fc2"), "compensation that compensation switches off; add refit none"),
        (dict(refit_shrink=-1.0), "refit_shrink must be a finite number >= 0"),
        (dict(refit="all"), "refit must be one of none, fc2, proj+fc2"),
    ],
)
def test_refit_settings_are_checked(settings, message):
    with pytest.raises(SettingError, match=message.replace("+", r"\+")):
        CompressConfig.from_settings(s_mlp=0.5, **settings)


def test_the_refit_is_on_by_default_and_off_with_sequential_calibration():
    assert CompressConfig.from_settings(s_mlp=0.5).options.refit == "proj+fc2"
    assert CompressConfig.from_settings(s_mlp=0.5, calibration="sequential").options.refit == "none"
    without = CompressConfig.from_settings(s_mlp=0.5, compensation=False)  # what ran is what is recorded
    assert without.options.refit == "none" and without.to_dict()["refit"] == "none"
    shared = CorpOptions()  # each config resolves its own copy of the options
    assert CompressConfig(s_mlp=0.5, compensation=False, options=shared).options.refit == "none"
    assert CompressConfig(s_mlp=0.5, options=shared).options.refit == "proj+fc2" and shared.refit is None
