"""Value/output head-dim pruning (docs/method.md §4) against least squares on the raw inputs of the
output projection."""

import torch
from timm.layers.attention import Attention

from corp_deploy import CompressConfig, PrunedAttention, channels, compress
from corp_deploy.blocks import attention_forward
from corp_deploy.methods.corp import value_pruning
from corp_deploy.stats import MomentAccumulator

WIDTH, HEADS, HEAD_DIM, TOKENS = 24, 3, 8, 11


def attention_and_inputs(seed=0, images=40):
    torch.manual_seed(seed)
    attn = Attention(WIDTH, num_heads=HEADS, qkv_bias=True).double().eval()
    with torch.no_grad():
        attn.qkv.bias.normal_(0, 0.5)
        attn.proj.bias.normal_(0, 0.5)
    x = torch.randn(images, TOKENS, WIDTH, dtype=torch.float64)
    x[..., :4] += 2.0 * x[..., 4:8]  # correlated channels, so compensation has something to use
    return attn, x


def proj_inputs(attn, x):
    seen = []
    with torch.no_grad():
        attention_forward(attn, x, on_proj_input=seen.append)
    return seen[0].reshape(-1, HEADS * HEAD_DIM)


def test_value_fold_equals_least_squares_on_raw_projection_inputs():
    attn, x = attention_and_inputs()
    z = proj_inputs(attn, x)
    stats = MomentAccumulator(HEADS * HEAD_DIM)
    stats.update(z.float())
    kept_per_head = 5
    order = channels.keep_order(stats, attn.proj.weight.detach(), "combined", 0.0, groups=HEADS)
    S, P = channels.split_order(order, kept_per_head * HEADS)
    assert torch.bincount(S // HEAD_DIM, minlength=HEADS).tolist() == [kept_per_head] * HEADS
    sol = channels.solve_channels(stats, attn.proj.weight.detach(), S, P, alpha=0.0)

    # independent: regress the pruned channels on the kept ones (plus a constant) by lstsq
    zf = z.float().double()  # what the accumulator sees
    design = torch.cat([zf[:, S], torch.ones(len(zf), 1, dtype=zf.dtype)], 1)
    coef = torch.linalg.lstsq(design, zf[:, P]).solution
    torch.testing.assert_close(zf[:, S] @ sol.B.T + sol.c, design @ coef, rtol=0, atol=1e-5 * float(zf.std()))

    pruned = value_pruning.fold_values(attn, S, P, sol.B, sol.c)
    assert isinstance(pruned, PrunedAttention)
    assert (pruned.qk_head_dim, pruned.v_head_dim) == (HEAD_DIM, kept_per_head)
    w, b = attn.proj.weight.detach(), attn.proj.bias.detach()
    expected = zf[:, S] @ w[:, S].T + (design @ coef) @ w[:, P].T + b  # proj of the compensated input
    with torch.no_grad():
        got = pruned(x).reshape(-1, WIDTH)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * float(expected.std()))


def test_value_slicing_without_compensation_drops_the_channels():
    attn, x = attention_and_inputs(seed=1)
    z = proj_inputs(attn, x)
    keep = torch.tensor([0, 3, 8, 11, 16, 19])  # two value dims of each head
    drop = torch.tensor(sorted(set(range(HEADS * HEAD_DIM)) - set(keep.tolist())))
    pruned = value_pruning.fold_values(attn, keep, drop)
    with torch.no_grad():
        got = pruned(x).reshape(-1, WIDTH)
    expected = attn.proj(z[:, keep] @ torch.eye(HEADS * HEAD_DIM, dtype=z.dtype)[keep]).detach()
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_engine_value_pruning_matches_the_report_and_lowers_the_error(vit, image_batches):
    batches = image_batches(3, 8)
    model, report = compress(vit, batches, CompressConfig(target="vo", s_vo=0.5))
    sliced, report_sliced = compress(vit, batches, CompressConfig(target="vo", s_vo=0.5, compensation=False))
    for layer, layer_sliced, block in zip(report["layers"], report_sliced["layers"], model.blocks):
        assert layer["dims"]["v_head_dim"] == 8 and layer["dims"]["qk_head_dim"] == 16
        assert layer["values"]["error_compensated"] < layer_sliced["values"]["error_compensated"]
        assert block.attn.proj.in_features == 3 * 8
