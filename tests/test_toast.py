"""ToaSt (docs/method.md §5): the geometric median, coupled head-dim pruning, and token channel
importance, each on constructed examples."""

import numpy as np
import pytest
import torch
from scipy.optimize import minimize
from timm.layers.attention import Attention

from corp_deploy.blocks import project_qk
from corp_deploy.methods.toast import (
    TokenChannelImportance,
    class_token_attention,
    geometric_median,
    head_dim_importance,
    median_distances,
    prune_heads,
    top_dims,
)
from tests.helpers import FLOAT32


def test_geometric_median_of_constructed_sets():
    square = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0], [2.0, 2.0]])
    torch.testing.assert_close(geometric_median(square), torch.tensor([1.0, 1.0], dtype=torch.float64))
    line = torch.tensor([[0.0], [1.0], [2.0], [10.0], [11.0]])  # 1-D: the median, not the mean (4.8)
    torch.testing.assert_close(geometric_median(line), torch.tensor([2.0], dtype=torch.float64), atol=1e-8, rtol=0)
    # a point holding a majority is the median (plain Weiszfeld would divide by zero on it)
    majority = torch.tensor([[1.0, 1.0]] * 3 + [[5.0, 1.0], [1.0, 9.0]])
    torch.testing.assert_close(geometric_median(majority), torch.tensor([1.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(median_distances(majority), torch.tensor([0, 0, 0, 4.0, 8.0], dtype=torch.float64))


def test_geometric_median_minimises_the_sum_of_distances():
    points = torch.randn(16, 6, generator=torch.Generator().manual_seed(0)).double() ** 3
    total = lambda y: float(np.linalg.norm(points.numpy() - y, axis=1).sum())  # noqa: E731
    ours = geometric_median(points).numpy()
    reference = minimize(
        total,
        points.mean(0).numpy(),
        method="Nelder-Mead",
        options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 20000, "maxfev": 20000},
    ).x
    assert total(ours) <= total(reference) + 1e-9
    assert total(ours) < total(points.mean(0).numpy()) - 1e-3


def _attention(dim=24, heads=3, seed=0) -> Attention:
    torch.manual_seed(seed)
    attn = Attention(dim, num_heads=heads, qkv_bias=True).eval()
    with torch.no_grad():
        attn.qkv.bias.normal_(0, 0.3)
        attn.proj.bias.normal_(0, 0.3)
    return attn


def _zero_dims(attn: Attention, qk_dims: list[int], v_dims: list[int]) -> None:
    """Zero the given dims of every head: query and key rows (weight and bias) and value rows
    with their proj columns."""
    H, d, dim = attn.num_heads, attn.head_dim, attn.qkv.in_features
    with torch.no_grad():
        w, b = attn.qkv.weight.view(3, H, d, dim), attn.qkv.bias.view(3, H, d)
        w[:2, :, qk_dims] = 0
        b[:2, :, qk_dims] = 0
        w[2, :, v_dims] = 0
        b[2, :, v_dims] = 0
        attn.proj.weight.view(dim, H, d)[:, :, v_dims] = 0


def test_removing_zero_weight_dims_changes_nothing():
    attn = _attention()
    zero_qk, zero_v = [0, 2, 3, 5, 7], [1, 2, 4, 6, 7]  # 5 of 8 dims per head: a majority
    _zero_dims(attn, zero_qk, zero_v)
    qk_scores, v_scores = head_dim_importance(attn)
    # the zero vectors hold a majority, so the median is 0 and they are the least important
    assert torch.all(qk_scores[:, zero_qk] < 1e-9) and torch.all(v_scores[:, zero_v] < 1e-9)
    assert torch.all(qk_scores[:, [1, 4, 6]] > 0.1) and torch.all(v_scores[:, [0, 3, 5]] > 0.1)
    qk_kept, v_kept = top_dims(qk_scores, 3), top_dims(v_scores, 3)
    assert qk_kept.tolist() == [[1, 4, 6]] * 3 and v_kept.tolist() == [[0, 3, 5]] * 3
    pruned = prune_heads(attn, qk_kept, v_kept)
    assert (pruned.qk_head_dim, pruned.v_head_dim, pruned.scale) == (3, 3, attn.scale)
    assert pruned.proj.in_features == 9
    x = torch.randn(2, 10, 24)
    with torch.no_grad():
        torch.testing.assert_close(pruned(x), attn(x), rtol=1e-5, atol=1e-6)


def test_query_and_key_dims_leave_together_and_values_with_their_proj_columns():
    attn = _attention()
    qk_kept = torch.tensor([[0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 6, 7], [0, 1, 2, 5, 6, 7]])
    v_kept = torch.tensor([[2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]])
    pruned = prune_heads(attn, qk_kept, v_kept)
    x = torch.randn(2, 10, 24)
    # independent reference: per head, logits over the kept q/k dims, values over the kept v dims
    with torch.no_grad():
        qkv, out = attn.qkv(x), []
        for h in range(3):
            qh = qkv[..., h * 8 : (h + 1) * 8][..., qk_kept[h]]
            kh = qkv[..., 24 + h * 8 : 24 + (h + 1) * 8][..., qk_kept[h]]
            vh = qkv[..., 48 + h * 8 : 48 + (h + 1) * 8][..., v_kept[h]]
            probs = (attn.scale * qh @ kh.transpose(-1, -2)).softmax(-1)
            out.append((probs @ vh) @ attn.proj.weight[:, h * 8 + v_kept[h]].T)
        reference = sum(out) + attn.proj.bias
        torch.testing.assert_close(pruned(x), reference, rtol=1e-5, atol=1e-5)


def test_token_channel_importance_follows_the_formula():
    hidden = torch.tensor([[[1.0, -2.0], [3.0, 0.0], [-1.0, 4.0]]])  # 1 image, class token + 2 patches
    attention = torch.tensor([[0.2, 0.5, 0.3]])
    generator = torch.Generator().manual_seed(0)
    with_class = TokenChannelImportance(2, num_prefix_tokens=1, class_token=True, fraction=1.0, generator=generator)
    with_class.update(hidden, attention)
    expected = 2.0 * torch.tensor([1.0, 2.0]) + (0.5 * torch.tensor([3.0, 0.0]) + 0.3 * torch.tensor([1.0, 4.0])) / 2
    # scores are float32 per image, summed in float64
    torch.testing.assert_close(with_class.scores, expected.double(), **FLOAT32)
    pooled = TokenChannelImportance(2, num_prefix_tokens=1, class_token=False, fraction=1.0, generator=generator)
    pooled.update(hidden, None)
    pooled.update(2 * hidden, None)
    torch.testing.assert_close(pooled.scores, 1.5 * torch.tensor([2.0, 2.0], dtype=torch.float64), **FLOAT32)


@pytest.mark.parametrize("fraction, count", [(0.02, 4), (0.1, 20), (0.2, 39), (0.001, 1)])
def test_token_sample_is_the_fraction_of_patch_tokens_only(fraction, count):
    importance = TokenChannelImportance(197, 1, False, fraction, torch.Generator().manual_seed(0))
    importance.update(torch.eye(197)[None], None)  # token i lights channel i only
    sampled = importance.scores > 0
    assert not sampled[0] and int(sampled.sum()) == count  # never the class token
    torch.testing.assert_close(
        importance.scores[sampled], torch.full((count,), 1 / count, dtype=torch.float64), **FLOAT32
    )


def test_class_token_attention_is_the_softmax_row_of_token_zero():
    attn = _attention()
    x = torch.randn(2, 10, 24)
    with torch.no_grad():
        q, k, _ = attn.qkv(x).reshape(2, 10, 3, 3, 8).permute(2, 0, 3, 1, 4)
        full = (attn.scale * q @ k.transpose(-1, -2)).softmax(-1)  # (B, H, N, N)
        torch.testing.assert_close(class_token_attention(*project_qk(attn, x), attn.scale), full[:, :, 0].mean(1))
