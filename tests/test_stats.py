import torch

from corp_deploy.stats import MomentAccumulator, _add_lower_gram, per_image_head_grams, symmetrize_lower_
from tests.helpers import FLOAT32


def symmetric_gram(x):
    """x^T x through one-triangle accumulation (ssyrk for float32 on the CPU, panels otherwise)."""
    out = torch.zeros(x.shape[1], x.shape[1], dtype=x.dtype)
    _add_lower_gram(out, x)
    return symmetrize_lower_(out)


def test_symmetric_gram_equals_full_product():
    x = torch.randn(300, 1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(symmetric_gram(x), x.T @ x)
    torch.testing.assert_close(symmetric_gram(x.float()), (x.T @ x).float(), rtol=1e-4, atol=1e-3)


def test_moments_match_direct_computation_over_uneven_batches():
    g = torch.Generator().manual_seed(0)
    data = torch.randn(1000, 20, generator=g) * 3 + 50  # large mean: centring matters
    acc = MomentAccumulator(20)
    for chunk in torch.split(data, [1, 99, 400, 500]):
        acc.update(chunk)
    d = data.double()
    assert acc.n == 1000
    # the data are float32 and centred in float32: compare at float32's resolution
    torch.testing.assert_close(acc.mean, d.mean(0), **FLOAT32)
    torch.testing.assert_close(acc.covariance, torch.cov(d.T, correction=0), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(acc.second_moment_diag, (d ** 2).mean(0), rtol=1e-6, atol=0)
    torch.testing.assert_close(acc.positive_rate, (d > 0).double().mean(0))


def test_per_image_head_grams():
    t = torch.randn(2, 3, 7, 5, generator=torch.Generator().manual_seed(0))
    grams = per_image_head_grams(t)
    assert grams.shape == (2, 3, 5, 5) and grams.dtype == torch.float64
    # formed in float32 (documented), so checked against a float64 reference at float32's resolution
    reference = t.double().transpose(-1, -2) @ t.double()
    torch.testing.assert_close(grams, reference, **FLOAT32)
