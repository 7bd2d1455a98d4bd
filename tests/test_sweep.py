"""`corp-deploy sweep` on a tiny random model: one artifact and export per method and sparsity,
the tables at matched sparsity and matched MACs, the plot, and bad requests."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.sweep import at_macs
from corp_deploy import read_config
from exporters.manifest import read_manifest
from tests.helpers import SMALL_VIT_CLI_ARGS


@pytest.mark.slow
def test_sweep_compares_methods_in_one_table_and_plot(tmp_path, run_cli):
    out = tmp_path / "sweep"
    result, text = run_cli(
        [
            "sweep",
            "deit_tiny",
            "--no-pretrained",
            *SMALL_VIT_CLI_ARGS,
            "--s",
            "0.25,0.5",
            "--methods",
            "corp,vbp,toast,uncompensated",
            "--calib-samples",
            8,
            "--data-samples",
            6,
            "--backends",
            "ort",
            "--batch",
            "1,2",
            "--min-time",
            0.02,
            "-o",
            out,
        ],
        tmp_path / "state",
    )
    assert result.exit_code == 0, text
    runs = [f"{m}-s{s}" for m in ("corp", "vbp", "toast", "uncompensated") for s in ("0.25", "0.5")]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        runs + ["corp-deploy-record.json", "sweep.json", "sweep.md", "sweep.png"]
    )
    sweep = json.loads((out / "sweep.json").read_text())
    assert [(row["method"], row["sparsity"]) for row in sweep["rows"]] == [
        (m, s) for m in ("corp", "vbp", "toast", "uncompensated") for s in (0.25, 0.5)
    ]
    assert sweep["base_model"]["weights"] == {"source": "random", "seed": 0}
    for row in sweep["rows"]:
        config = read_config(out / f"{row['method']}-s{row['sparsity']:g}")
        assert config.settings["method"] == ("corp" if row["method"] == "uncompensated" else row["method"])
        assert config.settings["compensation"] == (row["method"] != "uncompensated")
        assert row["target"] == ("mlp" if row["method"] == "vbp" else "both")
        assert [(r["backend"], r["batch"]) for r in row["latency"]] == [("ort-cpu", 1), ("ort-cpu", 2)]
        assert row["ideal_speedup"] == row["macs"]["dense"] / row["macs"]["compressed"] > 1
        assert row["fidelity"]["images"] == 6 and 0 <= row["fidelity"]["top1_agreement"] <= 1
        assert row["fidelity"]["held_out"] is True
        # file paths are relative to the sweep directory (never the staging directory it was built in)
        assert row["artifact"] == f"{row['method']}-s{row['sparsity']:g}"
        for files in row["bench"]["models"].values():
            assert not Path(files["onnx"]).is_absolute() and (out / files["onnx"]).is_file()
    rows = {(row["method"], row["sparsity"]): row for row in sweep["rows"]}
    # same channels, same shapes: CORP and its uncompensated ablation cost the same
    assert rows["corp", 0.5]["macs"] == rows["uncompensated", 0.5]["macs"]
    # VBP prunes only the MLP, ToaSt also value dims: at equal s, MACs order toast < corp < vbp
    assert (
        rows["toast", 0.5]["macs"]["compressed"]
        < rows["corp", 0.5]["macs"]["compressed"]
        < rows["vbp", 0.5]["macs"]["compressed"]
    )
    # the dense model is exported once, with the first run, and benchmarked from there
    assert sorted(read_manifest(out / "corp-s0.25" / "export-fp32").models) == ["dense", "model"]
    assert sorted(read_manifest(out / "vbp-s0.5" / "export-fp32").models) == ["model"]
    table = (out / "sweep.md").read_text()
    assert "| s | corp | vbp | toast | uncompensated |" in table
    assert "| GMACs | corp | vbp | toast | uncompensated |" in table
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_matched_macs_interpolates_between_runs_and_refuses_to_extrapolate():
    curve = [(200, 0.9), (100, 0.5)]  # (compressed MACs, fidelity) of each run, in any order
    assert at_macs(curve, 150) == pytest.approx(0.7)
    assert at_macs(curve, 200) == 0.9
    assert at_macs(curve, 99) is None and at_macs(curve, 201) is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["--s", "0.3,1.2"], "--s must be in [0, 1)"),
        (["--s", "a,b"], "'--s': takes comma-separated"),
        (["--s", ""], "'--s': takes comma-separated"),  # an empty CI variable is not the default grid
        (["--macs", ""], "'--macs': takes comma-separated"),
        (["--methods", "corp,magic"], "methods must be distinct names from corp, vbp, toast, uncompensated"),
        (["--methods", "corp,corp"], "methods must be distinct"),
        (["--methods", "vbp", "--target", "attn"], "--methods vbp prunes MLP hidden channels only; --target attn"),
    ],
)
def test_bad_sweeps_are_refused_before_any_work(tmp_path, args, message, run_cli):
    result, text = run_cli(
        ["sweep", "deit_tiny", "--no-pretrained", *SMALL_VIT_CLI_ARGS, *args, "-o", tmp_path / "sweep"],
        tmp_path / "state",
    )
    assert result.exit_code == 2 and message in text and "Traceback" not in text, text
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_sweep_over_mac_budgets(tmp_path, run_cli):
    out = tmp_path / "sweep"
    result, text = run_cli(
        [
            "sweep",
            "deit_tiny",
            "--no-pretrained",
            *SMALL_VIT_CLI_ARGS,
            "--macs",
            "0.8,0.5",
            "--methods",
            "corp,uncompensated",
            "--calib-samples",
            8,
            "--data-samples",
            4,
            "--backends",
            "ort",
            "--batch",
            "1",
            "--min-time",
            0.02,
            "-o",
            out,
        ],
        tmp_path / "state",
    )
    assert result.exit_code == 0, text
    sweep = json.loads((out / "sweep.json").read_text())
    assert [(row["method"], row["budget"]) for row in sweep["rows"]] == [
        (m, f) for m in ("corp", "uncompensated") for f in (0.8, 0.5)
    ]
    for row in sweep["rows"]:
        config = read_config(out / f"{row['method']}-macs{row['budget']:g}")
        assert config.settings["macs"] == row["budget"] and config.allocation["budget_macs"] > 0
        assert row["macs"]["compressed"] <= row["budget"] * row["macs"]["dense"]
    rows = {(row["method"], row["budget"]): row for row in sweep["rows"]}
    assert rows["corp", 0.5]["macs"] == rows["uncompensated", 0.5]["macs"]  # same allocation, only sliced
    result, text = run_cli(["sweep", "deit_tiny", "--no-pretrained", "--s", "0.5", "--macs", "0.5"], tmp_path / "state")
    assert result.exit_code == 2 and "exclude each other" in text


@pytest.mark.slow
def test_a_sweep_with_recovery_runs_every_point_also_recovered(tmp_path, run_cli):
    """--recover-steps adds the method corp+rec<N>: the same compression, then recovered (recorded in
    its artifact, with the sweep's seed), a row and a table column beside corp's; sweep.json reads
    back with the recovery."""
    from benchmarks.sweep import SweepResult

    out = tmp_path / "sweep"
    result, text = run_cli(
        ["sweep", "deit_tiny", "--no-pretrained", *SMALL_VIT_CLI_ARGS, "--s", "0.5", "--calib-samples", 8]
        + ["--data-samples", 4, "--backends", "ort", "--batch", "1", "--min-time", 0.02]
        + ["--recover-steps", 2, "--recover-batch-size", 4, "--recover-eval-every", 1, "--seed", 3, "-o", out],
        tmp_path / "state",
    )
    assert result.exit_code == 0, text
    sweep = SweepResult.read(out / "sweep.json")
    assert [(row.method, row.artifact) for row in sweep.rows] == [
        ("corp", "corp-s0.5"),
        ("corp+rec2", "corp+rec2-s0.5"),
    ]
    assert sweep.spec.recovery.steps == 2 and sweep.rows[0].macs == sweep.rows[1].macs
    plain, recovered = (read_config(out / row.artifact).settings for row in sweep.rows)
    assert "recover_steps" not in plain and recovered["recover_steps"] == 2
    assert recovered["recover_seed"] == recovered["seed"] == 3  # the recovery's seed is the sweep's, as in compress
    assert (out / "corp+rec2-s0.5" / "report.json").exists() and "| s | corp | corp+rec2 |" in text
    outcome = sweep.rows[1].recovery  # whether a step was kept, in sweep.json and sweep.md
    assert sweep.rows[0].recovery is None and outcome["steps_run"] <= 2 and outcome["best_step"] in (0, 1, 2)
    assert f"- corp+rec2-s0.5: {outcome['steps_run']} steps ({outcome['stopped']}), kept " in text
    assert "recovering: step 1/2, loss" in text  # recovery's progress (the CLI's stderr is no terminal here)


def test_a_recovering_sweep_refuses_too_few_sources_before_the_first_point(tmp_path, run_cli, monkeypatch):
    """One calibration image cannot be split for recovery: refused before anything is compressed,
    as compress refuses it (the sweep compressed, exported and timed its first, plain, point before)."""
    import benchmarks.sweep

    def compressed(*args, **kwargs):
        raise AssertionError("a point was compressed before the refusal")

    monkeypatch.setattr(benchmarks.sweep, "compress_to_artifact", compressed)
    (tmp_path / "calib").mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(
        tmp_path / "calib" / "one.png"
    )
    result, text = run_cli(
        ["sweep", "deit_tiny", "--no-pretrained", *SMALL_VIT_CLI_ARGS, "--s", "0.5", "--calib", tmp_path / "calib"]
        + ["--recover-steps", 2, "-o", tmp_path / "sweep"],
        tmp_path / "state",
    )
    assert result.exit_code == 1 and "at least 2 distinct sources (one to train on, one to validate); got 1" in text
    assert not (tmp_path / "sweep").exists()


def test_methods_without_shared_calibration_are_refused_under_torchrun(tmp_path, monkeypatch, small_vit):
    """Under torch.distributed a sweep runs CORP, its uncompensated ablation and VBP only (ToaSt's
    statistics are not summed over the processes), and says so before any work (nothing written)."""
    from benchmarks.sweep import SweepSpec, run_sweep
    from corp_deploy import CorpError, distributed

    monkeypatch.setattr(distributed, "active", lambda: True)
    spec = SweepSpec(sparsities=(0.5,), methods=("corp", "toast"))
    with pytest.raises(CorpError, match="under torchrun a sweep runs only corp, uncompensated, vbp"):
        run_sweep(small_vit(), {}, spec, tmp_path / "sweep")
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_sweep_in_half_precision_says_so_and_warns_of_a_lost_fused_kernel(tmp_path, run_cli):
    """As bench does: the precision in sweep.md, the backends skipped, and the warning when the compressed model's
    attention runs math where the dense model's does not (forced to flash or math, so the oracle
    does not depend on the kernel PyTorch would pick: flash needs equal head dims, 11/16 are not)."""
    out = tmp_path / "sweep"
    args = ["sweep", "deit_tiny", "--no-pretrained", *SMALL_VIT_CLI_ARGS, "--s", "0.3", "--methods", "corp"]
    args += ["--calib-samples", 8, "--data-samples", 2, "--backends", "torch,trt", "--batch", "1", "--min-time", 0.01]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        result, text = run_cli([*args, "--torch-precision", "bf16", "-o", out], tmp_path / "state")
    assert result.exit_code == 0, text
    table = (out / "sweep.md").read_text()
    assert "On the CPU device-resident and host-to-host timing are one measurement. PyTorch timed in bf16." in table
    assert "| torch-cpu bf16 speedup b1 (of ideal) |" in table
    assert json.loads((out / "sweep.json").read_text())["rows"][0]["bench"]["attention"]["torch-cpu"] == {
        "dense": "flash x2",
        "compressed": "math x2",
    }
    said = " ".join(text.split())
    assert "corp-s0.3: on torch-cpu the compressed model's attention runs math x2, the dense model's flash x2: " in said
    assert "corp-s0.3: skipped trt: " in said  # no GPU here: each skipped backend is said, as bench says it
