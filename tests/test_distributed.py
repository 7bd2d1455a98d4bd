"""Data-parallel calibration (corp_deploy/distributed.py): with the gloo backend and 2 CPU processes,
statistics summed over the ranks equal the single-process statistics of all samples."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from corp_deploy import CompressConfig, compress, distributed
from corp_deploy.stats import HeadGrams, MomentAccumulator
from tests.helpers import FLOAT32, build_small_vit


def run_ranks(worker, tmp_path: Path, world: int = 2, *args) -> list:
    """Run ``worker(*args)`` in ``world`` gloo processes; returns what each rank's call returned."""
    mp.spawn(_rank_main, args=(world, str(tmp_path), worker, args), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _rank_main(rank: int, world: int, folder: str, worker, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    try:
        torch.save(worker(*args), Path(folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def samples(n: int = 500, d: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, d, generator=g) @ torch.randn(d, d, generator=g) + 3.0


def _moments_of_my_share(data: torch.Tensor) -> dict:
    start, stop = distributed.shard_range(len(data))
    acc = MomentAccumulator(data.shape[1])
    for batch in data[start:stop].split(37):
        acc.update(batch)
    acc.all_reduce()
    return {"n": acc.n, "mean": acc.mean, "covariance": acc.covariance, "positive": acc.positive_rate,
            "share": stop - start}


def test_moments_summed_over_ranks_equal_those_of_all_samples(tmp_path):
    data = samples()
    single = MomentAccumulator(data.shape[1])
    for batch in data.split(37):
        single.update(batch)
    ranks = run_ranks(_moments_of_my_share, tmp_path, 2, data)
    assert [r["share"] for r in ranks] == [250, 250]
    scale = float(single.covariance.abs().max())
    for result in ranks:  # the products are float32 (stats.py), centred on other shifts on each rank
        assert result["n"] == single.n
        torch.testing.assert_close(result["mean"], single.mean, **FLOAT32)
        torch.testing.assert_close(result["covariance"], single.covariance, rtol=1e-5, atol=1e-6 * scale)
        torch.testing.assert_close(result["positive"], single.positive_rate, rtol=0, atol=0)
    torch.testing.assert_close(ranks[0]["covariance"], ranks[1]["covariance"], rtol=0, atol=0)


def _head_grams_of_my_share(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    start, stop = distributed.shard_range(len(q))
    grams = HeadGrams()
    for qb, kb in zip(q[start:stop].split(2), k[start:stop].split(2)):
        grams.add(qb, kb)
    grams.all_reduce()
    return grams.head_major()


def test_head_grams_gathered_in_rank_order_equal_the_single_process_ones(tmp_path):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(7, 2, 5, 4, generator=g), torch.randn(7, 2, 5, 4, generator=g)
    single = HeadGrams()
    single.add(q, k)
    expected = single.head_major()
    for result in run_ranks(_head_grams_of_my_share, tmp_path, 2, q, k):
        for got, want in zip(result, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_samples_after_the_reduction_are_refused():
    acc = MomentAccumulator(3)
    acc.update(torch.randn(4, 3))
    acc._reduced = True  # what all_reduce leaves behind under torchrun
    with pytest.raises(RuntimeError, match="after all_reduce"):
        acc.update(torch.randn(4, 3))


def _compress_on_my_share(config: CompressConfig, x: torch.Tensor) -> dict:
    vit, batches = build_small_vit(), _calibration_batches()
    model, report = compress(vit, batches, config)
    with torch.no_grad():
        return {"output": model(x), "dims": [layer["dims"] for layer in report["layers"]],
                "budget": report.get("budget"), "distributed": report["distributed"],
                "images": report["calibration"]["images"]}


def _calibration_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(size, 3, 32, 32, generator=g) for size in (8, 8, 8, 5)]


@pytest.mark.parametrize("settings", [dict(s_mlp=0.5, s_attn=0.5), dict(macs=0.5),
                                      dict(target="all", s_mlp=0.5, s_attn=0.5, s_vo=0.5, calibration="sequential")],
                         ids=["uniform", "budget", "sequential"])
def test_compress_on_two_processes_equals_one_process(tmp_path, settings):
    """The same kept dims (uniform and budget: the budget's curves, probes and allocation see the
    same sums) and the same outputs up to float summation order."""
    config = CompressConfig.from_settings(**settings)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(9))
    single, report = compress(build_small_vit(), _calibration_batches(), config)
    with torch.no_grad():
        expected = single(x)
    for result in run_ranks(_compress_on_my_share, tmp_path, 2, config, x):
        assert result["distributed"] == {"world_size": 2, "images_per_rank": [16, 13]}
        assert result["images"] == 29
        assert result["dims"] == [layer["dims"] for layer in report["layers"]]
        if "macs" in settings:
            assert [u["kept"] for u in result["budget"]["units"]] == [u["kept"] for u in report["budget"]["units"]]
        # observed 2e-7 (outputs ~0.9); without the reduction of the statistics 3e-4
        torch.testing.assert_close(result["output"], expected, rtol=1e-5, atol=1e-5)
