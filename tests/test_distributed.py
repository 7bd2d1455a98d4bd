"""Data-parallel calibration (corp_deploy/distributed.py): with the gloo backend and 2 CPU processes,
statistics summed over the ranks equal the single-process statistics of all samples."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from corp_deploy import CompressConfig, compress, distributed, model_transform
from corp_deploy.artifact import load_compressed
from corp_deploy.methods.corp.qk_statistics import HeadGrams, images_worth_the_sums
from corp_deploy.recovery import RecoveryImages
from corp_deploy.stats import MomentAccumulator
from tests.helpers import FLOAT32, SMALL_VIT_CLI_ARGS, build_small_vit


def run_ranks(worker, tmp_path: Path, world: int = 2, *args) -> list:
    """Run ``worker(*args)`` in ``world`` gloo processes; returns what each rank's call returned."""
    mp.spawn(_rank_main, args=(world, str(tmp_path), worker, args), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]


def _rank_main(rank: int, world: int, folder: str, worker, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    try:
        torch.save(worker(*args), Path(folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _my_range(count: int) -> tuple[int, int]:
    """``[start, stop)``: this rank's consecutive share of ``count`` items."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return rank * count // world, (rank + 1) * count // world


def samples(n: int = 500, d: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, d, generator=g) @ torch.randn(d, d, generator=g) + 3.0


def _moments_of_my_share(data: torch.Tensor) -> dict:
    start, stop = _my_range(len(data))
    acc = MomentAccumulator(data.shape[1])
    for batch in data[start:stop].split(37):
        acc.update(batch)
    acc.all_reduce()
    return {
        "n": acc.n,
        "mean": acc.mean,
        "covariance": acc.covariance,
        "positive": acc.positive_rate,
        "share": stop - start,
    }


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


#: ``HeadGrams(summed_after)`` for 7 images of head dim 4 over 2 ranks (4 + 3; the Grams' memory
#: passes the sums' after 6 images): gathered; summed at the reduction; summed by one rank while adding.
SWITCHES = {100: "gathered", None: "summed at the reduction", 3: "summed by one rank while adding"}


def _head_grams_of_my_share(q: torch.Tensor, k: torch.Tensor) -> dict:
    start, stop = _my_range(len(q))
    states = {}
    for summed_after in SWITCHES:
        grams = HeadGrams(summed_after)
        for qb, kb in zip(q[start:stop].split(2), k[start:stop].split(2)):
            grams.add(qb, kb)
        grams.all_reduce()
        states[str(summed_after)] = _grams_state(grams)
    return states


def _grams_state(grams: HeadGrams) -> dict:
    if grams.kronecker is not None:
        return {"n": grams.n, "kronecker": grams.kronecker}
    return {"n": grams.n, "query": torch.cat(grams.query), "key": torch.cat(grams.key)}


def test_head_grams_over_ranks_equal_the_single_process_ones(tmp_path):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(7, 2, 5, 4, generator=g), torch.randn(7, 2, 5, 4, generator=g)
    ranks = run_ranks(_head_grams_of_my_share, tmp_path, 2, q, k)
    for summed_after, form in SWITCHES.items():
        single = HeadGrams(summed_after)
        single.add(q, k)
        expected = _grams_state(single)
        assert ("kronecker" in expected) == (form != "gathered")
        exact = dict(rtol=0, atol=0) if form == "gathered" else dict(rtol=1e-12, atol=1e-12)  # other sum order
        for states in ranks:
            result = states[str(summed_after)]
            assert result.keys() == expected.keys() and result["n"] == 7, form
            for name in set(expected) - {"n"}:
                torch.testing.assert_close(result[name], expected[name], **exact)


def test_samples_after_the_reduction_are_refused():
    acc = MomentAccumulator(3)
    acc.update(torch.randn(4, 3))
    acc._reduced = True  # what all_reduce leaves behind under torchrun
    with pytest.raises(RuntimeError, match="after all_reduce"):
        acc.update(torch.randn(4, 3))


def _compress_on_my_share(config: CompressConfig, x: torch.Tensor, sizes: tuple[int, ...]) -> dict:
    vit, batches = build_small_vit(), _calibration_batches(sizes)
    model, report = compress(vit, batches, config)
    with torch.no_grad():
        return {
            "output": model(x),
            "dims": [layer["dims"] for layer in report["layers"]],
            "budget": report.get("budget"),
            "distributed": report["distributed"],
            "images": report["calibration"]["images"],
            "recovered_from_step": report.get("recovery", {}).get("best_step"),
        }


def _calibration_batches(sizes: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(size, 3, 32, 32, generator=g) for size in sizes]


#: Calibration batches whose query/key statistics are kept as Kronecker sums (80 images).
PAST_THE_GRAMS = (32, 32, 16)


@pytest.mark.parametrize(
    "settings, sizes",
    [
        (dict(s_mlp=0.5, s_attn=0.5), (8, 8, 8, 5)),
        (dict(macs=0.5), (8, 8, 8, 5)),
        (dict(macs=0.5), (32, 8, 8)),  # the budget's 32 probe images all on the first process
        (dict(target="all", s_mlp=0.5, s_attn=0.5, s_vo=0.5, calibration="sequential"), (8, 8, 8, 5)),
        (dict(s_mlp=0.5, s_attn=0.5), PAST_THE_GRAMS),
        (dict(macs=0.5), PAST_THE_GRAMS),
        (dict(method="vbp", s_mlp=0.5), (8, 8, 8, 5)),
        (
            dict(s_mlp=0.75, s_attn=0.75, compensation=False, recover_steps=4, recover_batch_size=4, recover_lr=3e-3)
            | dict(recover_eval_every=2, recover_pooled_weight=1.0),  # the pooled term: outside the DDP module
            (8, 8, 8, 5),
        ),
    ],
    ids=[
        "uniform",
        "budget",
        "budget-probes-on-one-process",
        "sequential",
        "uniform-qk-sums",
        "budget-qk-sums",
        "vbp",
        "recovery",
    ],
)
def test_compress_on_two_processes_equals_one_process(tmp_path, settings, sizes):
    """The same kept dims (uniform and budget: the budget's curves, probes and allocation see the
    same sums; its query/key factorisations are split between the processes; VBP: its global
    variance ranking sees the merged moments) and the same outputs up to float summation order.
    With 80 images the query/key statistics are past the images worth their Kronecker sums (72 at
    the small ViT's head dim 16), though neither process's share is: each folds its Grams at the
    reduction. A recovery after compression (DistributedDataParallel, each process running half of
    every batch) gives the one-process weights."""
    if sizes == PAST_THE_GRAMS:
        assert sum(sizes) > images_worth_the_sums(16) > max(sum(sizes[0::2]), sum(sizes[1::2]))
    config = CompressConfig.from_settings(**settings)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(9))
    single, report = compress(build_small_vit(), _calibration_batches(sizes), config)
    with torch.no_grad():
        expected = single(x)
    fitted = sizes
    if config.recovery.enabled:  # compression fits on the images of the sources recovery trains on
        data_config = model_transform(build_small_vit())[1]
        fitted = [
            len(b) for b in RecoveryImages(_calibration_batches(sizes), data_config, config.recovery).fit_batches()
        ]
        assert sum(fitted) < sum(sizes)
    for result in run_ranks(_compress_on_my_share, tmp_path, 2, config, x, sizes):
        shares = [sum(fitted[0::2]), sum(fitted[1::2])]
        assert result["distributed"] == {"world_size": 2, "images_per_rank": shares}
        assert result["images"] == sum(fitted)
        assert result["dims"] == [layer["dims"] for layer in report["layers"]]
        if "macs" in settings:
            assert [u["kept"] for u in result["budget"]["units"]] == [u["kept"] for u in report["budget"]["units"]]
        if "recover_steps" in settings:  # weights the recovery trained, not compression's kept
            assert result["recovered_from_step"] == report["recovery"]["best_step"] > 0
        # observed 2e-7 (outputs ~0.9); without the reduction of the statistics 3e-4
        torch.testing.assert_close(result["output"], expected, rtol=1e-5, atol=1e-5)


def torchrun_compress(
    args: list, out: Path, state: Path, processes: int = 2, command_name: str = "compress"
) -> subprocess.Popen:
    """``torchrun --standalone --nproc-per-node N --no-python -- corp-deploy compress ARGS -o OUT``
    (the small ViT, random weights; plain ``corp-deploy`` for one process; ``command_name`` another
    command than compress) started in the background, one thread per process (a thread count alone
    moves solved weights at float rounding)."""
    command = [
        str(Path(sys.executable).parent / "corp-deploy"),
        command_name,
        "deit_tiny",
        "--no-pretrained",
        *SMALL_VIT_CLI_ARGS,
        *[str(a) for a in args],
        "-o",
        str(out),
    ]
    if processes > 1:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(processes),
            "--no-python",
            "--",
            *command,
        ]
    env = {**os.environ, "CORP_DEPLOY_STATE_DIR": str(state), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_torchrun_compress_writes_one_artifact_equal_to_one_process(tmp_path):
    args = ["--calib-samples", 24, "--batch-size", 4, "--macs", 0.6]
    for processes, folder in ((2, "two"), (1, "one")):
        job = torchrun_compress(args, tmp_path / folder, tmp_path / "state", processes)
        output, _ = job.communicate(timeout=600)
        assert job.returncode == 0, output
        assert "Traceback" not in output
    report = json.loads((tmp_path / "two" / "report.json").read_text())
    assert report["distributed"] == {"world_size": 2, "images_per_rank": [12, 12]}
    single = json.loads((tmp_path / "one" / "report.json").read_text())
    assert [layer["dims"] for layer in report["layers"]] == [layer["dims"] for layer in single["layers"]]
    two, one = load_compressed(tmp_path / "two"), load_compressed(tmp_path / "one")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = two(x), one(x)
    # The ranks' float32 Grams round differently (other shifts, other sums); the ridge solves amplify
    # that by up to ~1/alpha = 1e3, so outputs agree to ~1e-4 relative (observed 3e-5), not bit for bit.
    assert float((a - b).norm() / b.norm()) < 1e-4


HELD = """
import os, sys, threading
import corp_deploy.engine as engine
folder, rank, embed = sys.argv[1], os.environ["RANK"], engine.embed_tokens
def held(*args, **kwargs):  # the named point: rank 1 calibrating, where it stays until it is killed
    if rank == "1":
        with open(os.path.join(folder, "calibrating.tmp"), "w") as out:
            out.write(str(os.getpid()))
        os.rename(os.path.join(folder, "calibrating.tmp"), os.path.join(folder, "calibrating"))
        threading.Event().wait()
    return embed(*args, **kwargs)
engine.embed_tokens = held
sys.argv = ["corp-deploy", *sys.argv[2:]]
from corp_deploy.launch import main
main()
"""


@pytest.mark.slow
def test_a_killed_process_ends_the_run_without_an_artifact(tmp_path):
    """One process killed mid-run (rank 1 held while it calibrates): torchrun stops the others, exits
    non-zero, and nothing is written where the artifact was to go. The others answer its SIGTERM within
    torchrun's grace; had they not, it would have killed them once the grace was over, saying so
    ("Unable to shutdown process ... via SIGTERM, forcefully exiting via SIGKILL")."""
    (tmp_path / "held.py").write_text(HELD)
    args = ["compress", "deit_tiny", "--no-pretrained", *SMALL_VIT_CLI_ARGS, "--calib-samples", "16"]
    job = _torchrun(tmp_path / "held.py", tmp_path, *args, "--batch-size", "4", "--macs", "0.5", "-o", tmp_path / "art")
    held = _wait_for(tmp_path / "calibrating", job)
    os.kill(int(held.read_text()), signal.SIGKILL)
    output, _ = job.communicate(timeout=600)
    assert job.returncode != 0, output
    assert "Unable to shutdown" not in output, output
    assert not (tmp_path / "art").exists()
    assert not list(tmp_path.glob("*art*"))  # no half-written temporary folder either


JOIN = """
import os, signal, sys, threading
from pathlib import Path
from corp_deploy import distributed
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a Python handler, as corp-deploy's own
folder, rank = Path(sys.argv[1]), os.environ["RANK"]
(folder / f"rank{rank}.tmp").write_text(str(os.getpid()))
(folder / f"rank{rank}.tmp").rename(folder / f"rank{rank}.pid")
if rank == "1":
    threading.Event().wait()  # never joins
distributed.init_from_environment("cpu")
"""


def test_a_process_waiting_to_join_the_group_is_stopped_at_once(tmp_path):
    """A rank that died before joining left the others waiting to join in one C++ call, where
    Python's signal handlers do not run: torchrun's SIGTERM went unanswered for its 30 s grace.
    While joining, SIGTERM now ends the process at once (nothing is being written then): rank 1 is
    killed once rank 0 has put SIGTERM back to its default action to join (its /proc status shows it
    no longer caught), and rank 0 ends by SIGTERM itself, not by torchrun's SIGKILL after the grace."""
    (tmp_path / "join.py").write_text(JOIN)
    job = _torchrun(tmp_path / "join.py", tmp_path)
    rank0, rank1 = (int(_wait_for(tmp_path / f"rank{r}.pid", job).read_text()) for r in (0, 1))
    _wait_for_sigterm_at_default(rank0, job)
    os.kill(rank1, signal.SIGKILL)
    output, _ = job.communicate(timeout=600)
    assert "Unable to shutdown" not in output and "exitcode  : -15" in output, output  # rank 0: SIGTERM


def _torchrun(script: Path, *args) -> subprocess.Popen:
    """``torchrun --standalone --nproc-per-node 2 SCRIPT ARGS`` in the background, one thread per process."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    return subprocess.Popen(
        [*command, *map(str, args)],
        env={**os.environ, "OMP_NUM_THREADS": "1", "CORP_DEPLOY_STATE_DIR": str(script.parent / "state")},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for(path: Path, job: subprocess.Popen) -> Path:
    """``path`` once a rank has written it (renamed into place whole): the point the test waits for.
    Polled, so a slow machine only waits longer; it fails only if the job ended without writing it."""
    while not path.exists():
        if job.poll() is not None:
            raise AssertionError(f"the job ended before {path.name} was written: {job.stdout.read()}")
        time.sleep(0.1)
    return path


def _wait_for_sigterm_at_default(pid: int, job: subprocess.Popen) -> None:
    """Until process ``pid`` no longer catches SIGTERM (its handler was put back to the default action)."""
    bit = 1 << (signal.SIGTERM - 1)
    while True:
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
        if not caught & bit:
            return
        if job.poll() is not None:
            raise AssertionError(f"the job ended before rank 0 joined: {job.stdout.read()}")
        time.sleep(0.1)


@pytest.mark.slow
def test_torchrun_sweep_writes_one_report_equal_to_one_process(tmp_path):
    """``sweep`` on 2 processes: one sweep folder and one printed report, recording the processes'
    shares; the point's kept sizes equal one process's and its fidelity agrees to float rounding."""
    args = [
        "--s",
        0.5,
        "--calib-samples",
        64,
        "--data-samples",
        8,
        "--backends",
        "ort",
        "--batch",
        1,
        "--min-time",
        0.1,
    ]
    outputs = {}
    for processes, folder in ((2, "two"), (1, "one")):
        job = torchrun_compress(args, tmp_path / folder, tmp_path / "state", processes, command_name="sweep")
        outputs[folder], _ = job.communicate(timeout=600)
        assert job.returncode == 0, outputs[folder]
        assert "Traceback" not in outputs[folder]
    assert outputs["two"].count("# corp-deploy sweep") == 1
    assert outputs["two"].count("corp-s0.5: compressing") == 1  # the log, from the first process only
    two, one = (json.loads((tmp_path / folder / "sweep.json").read_text()) for folder in ("two", "one"))
    assert two["distributed"] == {"world_size": 2, "images_per_rank": [32, 32]} and "distributed" not in one
    (row_two,), (row_one,) = two["rows"], one["rows"]
    assert row_two["params"] == row_one["params"] and row_two["macs"] == row_one["macs"]
    assert abs(row_two["fidelity"]["feature_cosine"] - row_one["fidelity"]["feature_cosine"]) < 1e-4


def test_only_compress_and_sweep_run_under_torchrun(tmp_path):
    """Another command started by torchrun would run once per process into the same outputs."""
    from click.testing import CliRunner

    from corp_deploy.cli import cli

    result = CliRunner().invoke(
        cli,
        ["export", str(tmp_path), "-o", str(tmp_path / "export")],
        env={"WORLD_SIZE": "2", "CORP_DEPLOY_STATE_DIR": str(tmp_path)},
    )
    assert result.exit_code == 1
    assert "only compress and sweep run under torchrun" in result.output and not (tmp_path / "export").exists()


def test_a_lost_peer_is_told_apart_from_a_bug(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distributed.lost_peer(RuntimeError("[pair.cc:561] Connection closed by peer [127.0.0.1]:16270"))
    assert not distributed.lost_peer(RuntimeError("cannot reshape tensor of 0 elements"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not distributed.lost_peer(RuntimeError("Connection closed by peer"))
