"""VBP (docs/method.md §5): Welford moments, the global variance allocation with its floor, and the
mean fold, which is exact for channels whose activation is constant."""

import pytest
import torch

from corp_deploy import CompressConfig, compress
from corp_deploy.methods.vbp import ChannelMoments, global_kept_counts


def test_channel_moments_match_a_two_pass_computation_on_offset_data():
    g = torch.Generator().manual_seed(0)
    chunks = [1e3 + torch.randn(n, 3, 5, generator=g) * torch.tensor([1e-2, 1.0, 3.0, 0.0, 1e2]) for n in (1, 7, 64)]
    moments = ChannelMoments(5)
    for chunk in chunks:
        moments.update(chunk)
    data = torch.cat(chunks).reshape(-1, 5).double()
    assert moments.n == 72 * 3
    torch.testing.assert_close(moments.mean, data.mean(0), rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(moments.variance, data.var(0, unbiased=False), rtol=1e-10, atol=1e-12)
    assert moments.variance[3] == 0


def test_global_allocation_removes_the_lowest_variances_across_layers():
    low, high = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([10.0, 20.0, 30.0, 40.0])
    # 4 of 8 removed: all from the low-variance layer when no floor protects it
    assert global_kept_counts([low, high], 0.5, floor=0.0) == [1, 3]  # one channel always stays
    assert global_kept_counts([low, high], 0.5, floor=0.5) == [2, 2]
    assert global_kept_counts([high, low], 0.25, floor=0.0) == [4, 2]
    assert global_kept_counts([low, high], 0.0, floor=0.5) == [4, 4]
    assert global_kept_counts([low, high], 0.5, floor=0.0, round_to=2) == [2, 4]


def _make_constant_channels(model, per_block: int) -> None:
    """fc1 rows with zero weight and a positive bias: act(b) is the same for every token."""
    with torch.no_grad():
        for block in model.blocks:
            block.mlp.fc1.weight[:per_block] = 0
            block.mlp.fc1.bias[:per_block] = torch.linspace(0.5, 2.0, per_block)


def test_mean_fold_is_exact_for_constant_channels(vit, batches, image_batches):
    _make_constant_channels(vit, per_block=48)  # 96 of 384 hidden channels in all: s = 0.25
    x = image_batches(1, 4, seed=7)[0]
    folded, report = compress(vit, batches, CompressConfig.from_settings(method="vbp", s_mlp=0.25, layer_floor=0.0))
    sliced, _ = compress(
        vit, batches, CompressConfig.from_settings(method="vbp", s_mlp=0.25, layer_floor=0.0, compensation=False)
    )
    assert [layer["mlp"]["hidden"] for layer in report["layers"]] == [144, 144]
    assert all(layer["mlp"]["pruned_variance_fraction"] < 1e-12 for layer in report["layers"])
    with torch.no_grad():
        dense = vit(x)
        torch.testing.assert_close(folded(x), dense, rtol=1e-5, atol=1e-5)
        assert (sliced(x) - dense).abs().max() > 1e-2  # without the fold the constants are lost


@pytest.mark.parametrize("bad", [dict(target="both"), dict(target="attn"), dict(calibration="sequential")])
def test_vbp_refuses_what_it_does_not_do(bad):
    from corp_deploy.errors import CorpError

    with pytest.raises(CorpError, match="vbp"):
        CompressConfig.from_settings(method="vbp", **bad)
