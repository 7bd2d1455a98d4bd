"""`corp-deploy sweep` on a tiny random model: one artifact and export per sparsity, the table,
the plot, and fidelity with and without compensation."""
import json

from corp_deploy import read_config
from exporters.manifest import read_manifest
from tests.conftest import SMALL_VIT_CLI_ARGS, run_cli


def test_sweep_writes_artifacts_table_plot_and_both_fidelities(tmp_path):
    out = tmp_path / "sweep"
    result, text = run_cli(["sweep", "deit_tiny", "--no-pretrained", *SMALL_VIT_CLI_ARGS, "--s", "0.25,0.5",
                            "--calib-samples", 8, "--data-samples", 6, "--compare-uncompensated", "--backends",
                            "ort", "--batch", "1,2", "--min-time", 0.02, "-o", out], tmp_path / "state")
    assert result.exit_code == 0, text
    assert sorted(p.name for p in out.iterdir()) == ["s0.25", "s0.5", "sweep.json", "sweep.md", "sweep.png"]
    sweep = json.loads((out / "sweep.json").read_text())
    assert [row["sparsity"] for row in sweep["rows"]] == [0.25, 0.5]
    assert sweep["base_model"]["weights"] == {"source": "random", "seed": 0}
    for row, hidden in zip(sweep["rows"], (144, 96)):
        assert read_config(out / f"s{row['sparsity']:g}")["blocks"][0]["mlp_hidden"] == hidden
        assert [(r["backend"], r["batch"]) for r in row["latency"]] == [("ort-cpu", 1), ("ort-cpu", 2)]
        assert row["ideal_speedup"] == row["macs"]["dense"] / row["macs"]["compressed"] > 1
        for key in ("fidelity", "fidelity_uncompensated"):
            assert row[key]["images"] == 6 and 0 <= row[key]["top1_agreement"] <= 1
        assert row["fidelity"]["held_out"] is True
    assert sweep["rows"][0]["ideal_speedup"] < sweep["rows"][1]["ideal_speedup"]
    # the dense model is exported once, with the first sparsity, and benchmarked from there
    assert sorted(read_manifest(out / "s0.25" / "export-fp32")["models"]) == ["dense", "model"]
    assert sorted(read_manifest(out / "s0.5" / "export-fp32")["models"]) == ["model"]
    assert sweep["rows"][1]["bench"]["models"]["dense"]["onnx"].endswith("s0.25/export-fp32/dense.onnx")
    table = (out / "sweep.md").read_text()
    assert "| 0.5 | " in table and "top-1 agreement with dense uncompensated" in table
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_sparsities_are_refused_before_any_work(tmp_path):
    for value, message in (("0.3,1.2", "s_mlp must be in [0, 1)"), ("a,b", "--s takes comma-separated")):
        result, text = run_cli(["sweep", "deit_tiny", "--no-pretrained", *SMALL_VIT_CLI_ARGS, "--s", value,
                                "-o", tmp_path / "sweep"], tmp_path / "state")
        assert result.exit_code == 1 and message in text and "Traceback" not in text, text
        assert not (tmp_path / "sweep").exists()
