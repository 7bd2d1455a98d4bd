import pytest
import torch

from corp_deploy.methods.corp.qk_statistics import HeadGrams, per_image_head_grams
from corp_deploy.stats import MomentAccumulator, _add_lower_gram, symmetrize_lower_
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
    torch.testing.assert_close(acc.second_moment_diag, (d**2).mean(0), rtol=1e-6, atol=0)
    torch.testing.assert_close(acc.positive_rate, (d > 0).double().mean(0))


def test_moments_of_joined_parts_in_small_chunks_match_direct_computation(monkeypatch):
    """``update(h, t)`` adds the samples ``[h, t]``; a batch is centred a few rows at a time."""
    monkeypatch.setattr(MomentAccumulator, "CHUNK_ELEMENTS", 7 * 5)  # 7 rows of the 5 joined dims
    g = torch.Generator().manual_seed(1)
    h, t = torch.randn(2, 30, 3, generator=g) + 4, torch.randn(2, 30, 2, generator=g) - 2
    acc = MomentAccumulator(5)
    acc.update(h[0], t[0])
    acc.update(h[1], t[1])
    d = torch.cat([h, t], -1).reshape(-1, 5).double()
    assert acc.n == 60
    torch.testing.assert_close(acc.mean, d.mean(0), **FLOAT32)
    torch.testing.assert_close(acc.covariance, torch.cov(d.T, correction=0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(acc.positive_rate, (d > 0).double().mean(0))


def test_moments_refuse_samples_once_the_covariance_is_read():
    """The covariance is formed in place of the sums (one d x d float64 matrix held, not two)."""
    acc = MomentAccumulator(4)
    acc.update(torch.randn(10, 4, generator=torch.Generator().manual_seed(0)))
    first = acc.covariance
    assert acc.covariance is first
    with pytest.raises(RuntimeError, match="after the covariance was read"):
        acc.update(torch.ones(2, 4))


def test_per_image_head_grams():
    t = torch.randn(2, 3, 7, 5, generator=torch.Generator().manual_seed(0))
    grams = per_image_head_grams(t)
    assert grams.shape == (2, 3, 5, 5) and grams.dtype == torch.float32
    # formed in float32 (documented), so checked against a float64 reference at float32's resolution
    reference = t.double().transpose(-1, -2) @ t.double()
    torch.testing.assert_close(grams.double(), reference, **FLOAT32)


def test_head_grams_switch_to_fixed_size_sums_past_the_images_worth_them():
    """Head dim 4: the sums take 10 x 10 float64 per head, the Grams of 6 images 6 x 2 x 4 x 4
    float32; from the 7th image on only the sums are kept, and they are those of every image."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(30, 2, 5, 4, generator=gen), torch.randn(30, 2, 5, 4, generator=gen)
    grams = HeadGrams()
    for start in range(0, 30, 3):
        grams.add(q[start : start + 3], k[start : start + 3])
        assert (grams.kronecker is None) == (start + 3 <= 6) and (grams.query == []) == (start + 3 > 6)
    assert grams.n == 30 and grams.kronecker.shape == (2, 10, 10) and grams.kronecker.dtype == torch.float64
    iu = torch.triu_indices(4, 4)
    for h, sums in enumerate(grams.heads()):
        a = (q[:, h].transpose(1, 2) @ q[:, h]).double()[:, iu[0], iu[1]]
        g = (k[:, h].transpose(1, 2) @ k[:, h]).double()[:, iu[0], iu[1]]
        torch.testing.assert_close(sums.z, a.T @ g, **FLOAT32)
