"""`corp-deploy bench`: report schema, interleaving, skipped backends, the regression gate,
fidelity metrics on known inputs, and accuracy on a labelled folder."""

import copy
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from benchmarks import latency
from benchmarks.data import eval_images, folders_overlap
from benchmarks.fidelity import FidelityMeter, features_and_logits
from benchmarks.gate import GateLimits, regressions
from benchmarks.report import to_markdown
from benchmarks.results import BenchReport
from benchmarks.targets import _export_preference, resolve_target
from corp_deploy import CorpError, load_compressed, model_transform

FAST = ["--backends", "torch,ort,trt", "--batch", "1,3", "--min-time", "0.02", "--warmup", "1", "--data-samples", "6"]


@pytest.fixture(scope="module")
def artifact(tiny_artifact, tmp_path_factory, run_cli):
    """A copy of the small compressed artifact with its fp32 export (dense included) inside."""
    root = tmp_path_factory.mktemp("bench")
    shutil.copytree(tiny_artifact, root / "art")
    result, text = run_cli(["export", root / "art", "--dense"], root / "state")
    assert result.exit_code == 0, text
    return root / "art"


@pytest.fixture(scope="module")
def bench_run(artifact, tmp_path_factory, run_cli):
    out = tmp_path_factory.mktemp("out")
    result, text = run_cli(["bench", artifact, *FAST, "-o", out], out / "state")
    assert result.exit_code == 0, text
    return json.loads((out / "bench.json").read_text()), out, text


def all_numbers(value):
    if isinstance(value, dict):
        return [n for v in value.values() for n in all_numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in all_numbers(v)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def test_report_schema_numbers_and_renderings(bench_run):
    report, out, text = bench_run
    assert report["format"] == "corp-deploy-bench" and report["format_version"] == 2
    assert {
        "machine",
        "versions",
        "settings",
        "models",
        "ideal_speedup",
        "backends",
        "latency",
        "parity",
        "fidelity",
        "gate",
    } <= set(report)
    assert all(math.isfinite(n) for n in all_numbers(report))
    assert report["settings"]["batches"] == [1, 3]
    models = report["models"]
    assert report["ideal_speedup"] == pytest.approx(models["dense"]["macs"] / models["compressed"]["macs"])
    ran = [name for name, backend in report["backends"].items() if backend["status"] == "ran"]
    assert {"torch-cpu", "ort-cpu"} <= set(ran)  # also torch-cuda (and ort-cuda) where a GPU is usable
    assert [(r["backend"], r["batch"]) for r in report["latency"]] == [(name, n) for name in ran for n in (1, 3)]
    for row in report["latency"]:
        for model in ("dense", "compressed"):
            t = row[model]
            assert t["runs"] >= 5 and 0 < t["min_s"] <= t["p50_s"] <= t["p90_s"] <= t["p99_s"]
            assert t["throughput_ips"] == pytest.approx(row["batch"] / t["p50_s"])
        s = row["speedup"]
        assert s["rounds"] == row["dense"]["runs"] and s["min"] <= s["p10"] <= s["median"] <= s["p90"] <= s["max"]
        assert row["efficiency"] == pytest.approx(s["median"] / report["ideal_speedup"])
    for model in ("dense", "compressed"):
        ort = report["parity"][model]["ort-cpu"]
        assert ort["max_abs"] < 1e-4 and ort["cosine"] > 0.9999
    fidelity = report["fidelity"]
    assert fidelity["images"] == 6 and fidelity["held_out"] is True and fidelity["accuracy"] is None
    assert 0 <= fidelity["top1_agreement"] <= 1 and fidelity["kl_mean"] >= 0
    assert report["gate"]["passed"] is True
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (out / "bench.md").read_text()
    assert "| ort-cpu | 3 |" in markdown and "## Fidelity" in markdown


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_backends_are_listed_with_the_reason(bench_run):
    report, out, text = bench_run
    backends = report["backends"]
    assert backends["torch-cpu"] == backends["ort-cpu"] == {"status": "ran"}
    for name in ("torch-cuda", "ort-cuda", "ort-tensorrt", "trt"):
        assert backends[name]["status"] == "skipped" and backends[name]["reason"], name
    assert "skipped trt:" in text.replace("\n", " ")
    assert "- ort-tensorrt: " in (out / "bench.md").read_text()


def test_interleaving_alternates_and_cancels_drift(monkeypatch):
    """A machine that slows down during the run: A costs 2 units and B 1 unit, times a factor
    that grows every round. Timed alternately, every round's ratio is still exactly 2."""
    clock, calls = [0.0], []
    monkeypatch.setattr(latency.time, "perf_counter", lambda: clock[0])

    def work(name, units):
        def run_once():
            calls.append(name)
            clock[0] += units * (1 + 0.5 * ((len(calls) - 1) // 2))

        return run_once

    samples = latency.interleaved({"A": work("A", 2.0), "B": work("B", 1.0)}, warmup=1, min_time=20, min_rounds=3)
    assert calls[:2] == ["A", "B"]  # warm-up, untimed
    assert calls[2:8] == ["A", "B", "B", "A", "A", "B"]
    assert len(samples["A"]) == len(samples["B"]) >= 3
    assert sum(samples["B"]) >= 20 > sum(samples["B"][:-1])  # stopped as soon as both had enough
    ratios = latency.speedup(samples["A"], samples["B"])
    assert ratios["min"] == pytest.approx(2.0, rel=1e-12) and ratios["max"] == pytest.approx(2.0, rel=1e-12)
    assert max(samples["B"]) > 2 * min(samples["B"])  # the drift was real


def test_gate_passes_on_identical_baseline_and_fails_on_a_doctored_one(bench_run, artifact, tmp_path, run_cli):
    report, _, _ = bench_run
    typed = BenchReport.from_dict
    limits = GateLimits(max_regression=0.05, min_parity_cosine=0.999)
    assert regressions(typed(report), limits, typed(copy.deepcopy(report))) == []
    doctored = copy.deepcopy(report)
    ort_rows = {row["batch"]: row for row in doctored["latency"] if row["backend"] == "ort-cpu"}
    ort_rows[1]["compressed"]["p50_s"] /= 2  # the baseline was "twice as fast"
    ort_rows[3]["speedup"]["median"] *= 1.5
    doctored["fidelity"]["feature_cosine"] = 1.0  # the most a cosine can be
    lowered = copy.deepcopy(report)
    lowered["fidelity"]["feature_cosine"] *= 0.9
    found = regressions(typed(lowered), limits, typed(doctored))
    assert found[0].startswith("latency: ort-cpu, batch 1: compressed p50") and "+100.0% > 5%" in found[0]
    assert found[1].startswith("speedup: ort-cpu, batch 3:")
    assert any(f.startswith("fidelity: feature cosine") for f in found)
    worse = copy.deepcopy(report)
    worse["fidelity"].update(top1_agreement=0.5, kl_mean=0.25, feature_cosine=0.75)
    assert regressions(typed(worse), GateLimits(min_agreement=0.9, max_kl=0.1, min_cosine=0.8)) == [
        "fidelity: top-1 agreement 0.5000 < 0.9",
        "fidelity: mean KL 0.25 > 0.1",
        "fidelity: feature cosine 0.7500 < 0.8",
    ]
    # the CLI: exit 4, every regression printed, the reports still written
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(doctored))
    result, text = run_cli(
        ["bench", artifact, *FAST, "--baseline", baseline, "--json", tmp_path / "new.json"],  # what it measured
        tmp_path / "state",
    )
    assert result.exit_code == 4, text
    assert "regression gate FAILED" in text and "latency: ort-cpu, batch 1: compressed p50" in text
    assert json.loads((tmp_path / "new.json").read_text())["gate"]["passed"] is False


def test_the_default_parity_limit_of_int8_graphs_is_their_export_gate(bench_run):
    """By default an int8 export's graphs are held to the cosine their export was gated on (0.98), not
    to the 0.999 of float graphs; the PyTorch backends and a limit given on the command line hold for
    every row."""
    report, _, _ = bench_run
    int8 = copy.deepcopy(report)
    for model in ("dense", "compressed"):
        int8["models"][model]["precision"] = "int8"
        int8["parity"][model]["ort-cpu"]["cosine"] = 0.99
    assert regressions(BenchReport.from_dict(int8), GateLimits()) == []
    assert regressions(BenchReport.from_dict(int8), GateLimits(parity_requested=True)) == [
        "parity: dense on ort-cpu vs torch-cpu fp32: cosine 0.990000 < 0.999",
        "parity: compressed on ort-cpu vs torch-cpu fp32: cosine 0.990000 < 0.999",
    ]
    int8["parity"]["compressed"]["ort-cpu"]["cosine"] = 0.97
    assert regressions(BenchReport.from_dict(int8), GateLimits()) == [
        "parity: compressed on ort-cpu vs torch-cpu fp32: cosine 0.970000 < 0.98 (the int8 graphs' own export gate)"
    ]
    float_graphs = copy.deepcopy(report)
    float_graphs["parity"]["compressed"]["ort-cpu"]["cosine"] = 0.99
    assert regressions(BenchReport.from_dict(float_graphs), GateLimits()) == [
        "parity: compressed on ort-cpu vs torch-cpu fp32: cosine 0.990000 < 0.999"
    ]


def test_baselines_that_cannot_gate_are_refused(bench_run, artifact, tmp_path, run_cli):
    """A baseline that timed nothing, or whose own gate failed, would let any later run pass; a
    report written over the baseline it is checked against would make a failing run the next one's."""
    report, _, _ = bench_run
    assert report["latency"] and report["gate"]["passed"] is True
    empty, failed, good = tmp_path / "empty.json", tmp_path / "failed.json", tmp_path / "good.json"
    empty.write_text(json.dumps({**report, "latency": []}))
    failed.write_text(json.dumps({**report, "gate": {**report["gate"], "passed": False}}))
    good.write_text(json.dumps(report))
    before = good.read_bytes()
    cases = [
        (["--baseline", empty, "--json", tmp_path / "r.json"], "it timed nothing"),
        (["--baseline", failed, "--json", tmp_path / "r.json"], "its own regression gate failed"),
        (["--baseline", good, "--json", good], "the reports would replace --baseline"),
        (["--baseline", tmp_path / "." / "good.json", "--json", good], "the reports would replace --baseline"),
    ]
    for args, message in cases:
        result, text = run_cli(["bench", artifact, *FAST, *args], tmp_path / "state")
        assert result.exit_code == 1 and message in text and "Traceback" not in text, (args, text)
    assert good.read_bytes() == before and not (tmp_path / "r.json").exists()


def test_folders_that_can_share_images_are_not_held_out(tmp_path):
    """Calibration and evaluation read folders recursively: a folder inside the other shares files."""
    calib, other = tmp_path / "cal", tmp_path / "cal-other"
    (calib / "sub").mkdir(parents=True)
    other.mkdir()
    (tmp_path / "link").symlink_to(calib / "sub")
    assert folders_overlap(calib, calib / "sub") and folders_overlap(calib / "sub", calib)
    assert folders_overlap(calib / "sub" / "..", calib) and folders_overlap(tmp_path / "link", calib)
    assert not folders_overlap(calib, other) and not folders_overlap(calib / "sub", other)


def test_fidelity_metrics_on_known_inputs():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 1.5, 0.0]])
    features = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    same = FidelityMeter(classifier=True)
    same.update((features, logits), (features.clone(), logits.clone()), labels=torch.tensor([0, 2]))
    result = same.result()
    assert result["top1_agreement"] == 1.0 and result["kl_mean"] == 0.0
    assert result["feature_cosine"] == pytest.approx(1.0)
    assert result["accuracy"] == {"dense": {"top1": 0.5, "top5": 1.0}, "compressed": {"top1": 0.5, "top5": 1.0}}

    other = torch.tensor([[2.0, 0.0, -1.0], [1.5, 0.5, 0.0]])  # second image: top-1 flips
    meter = FidelityMeter(classifier=True)
    meter.update((features, logits), (torch.tensor([[1.0, 1.0], [0.0, -2.0]]), other))
    p, q = torch.softmax(logits[1].double(), 0), torch.softmax(other[1].double(), 0)
    expected_kl = float((p * (p / q).log()).sum()) / 2
    result = meter.result()
    assert result["top1_agreement"] == 0.5 and result["kl_mean"] == pytest.approx(expected_kl, rel=1e-12)
    assert result["feature_cosine"] == pytest.approx((2**-0.5 - 1.0) / 2)
    backbone = FidelityMeter(classifier=False)
    backbone.update((features, features), (features, features))
    assert backbone.result()["top1_agreement"] is None and backbone.result()["kl_mean"] is None


def test_accuracy_on_a_labelled_image_folder(tmp_path, small_vit):
    model = small_vit()
    rng = np.random.default_rng(0)
    mapping = {"cats": 3, "dogs": 7}
    for name in mapping:
        (tmp_path / name).mkdir()
        for i in range(3):
            Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(tmp_path / name / f"{i}.png")
    (tmp_path / "class_index.json").write_text(json.dumps(mapping))
    transform, _ = model_transform(model)
    evaluation = eval_images(tmp_path, transform, limit=100, batch_size=4)
    assert evaluation.labelled and evaluation.description["classes"] == 2
    # independently: each file through the transform and the model, by hand
    expected = {"top1": 0, "top5": 0}
    with torch.no_grad():
        for name, label in mapping.items():
            for path in sorted((tmp_path / name).iterdir()):
                top = model(transform(Image.open(path).convert("RGB"))[None]).topk(5).indices[0]
                expected["top1"] += int(top[0] == label)
                expected["top5"] += int(label in top)
    meter = FidelityMeter(classifier=True)
    seen = []
    for images, labels in evaluation:
        seen += labels.tolist()
        out = features_and_logits(model, images)
        meter.update(out, out, labels)
    assert sorted(seen) == [3, 3, 3, 7, 7, 7]
    accuracy = meter.result()["accuracy"]["dense"]
    assert accuracy == {"top1": expected["top1"] / 6, "top5": expected["top5"] / 6}

    (tmp_path / "birds").mkdir()
    Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(tmp_path / "birds" / "0.png")
    with pytest.raises(CorpError, match="missing from .*class_index.json"):
        eval_images(tmp_path, transform, limit=10)


def test_an_artifacts_export_is_one_onnx_runtime_runs_on_the_cpu_first():
    names = ["export-bf16", "export-mine", "export-int8", "export-fp16", "export-fp32"]
    ordered = sorted((Path("art") / name for name in names), key=_export_preference)
    assert [p.name for p in ordered] == ["export-fp32", "export-fp16", "export-int8", "export-bf16", "export-mine"]


def test_targets_and_bad_inputs(artifact, tmp_path, other_tiny_artifact, run_cli):
    assert resolve_target(artifact) == (artifact, artifact / "export-fp32")
    assert resolve_target(artifact / "export-fp32") == (artifact, artifact / "export-fp32")
    not_a_report = tmp_path / "x.json"
    not_a_report.write_text("{}")
    cases = [  # (exit status 2: a value refused as such; 1: what it names cannot be used)
        (["bench", artifact, "--backends", "tensorflow"], "--backends takes", 2),
        (["bench", artifact, "--batch", "0,8"], "'--batch': takes comma-separated positive integers", 2),
        (["bench", artifact, "--baseline", not_a_report], "is not a corp-deploy bench report", 1),
        (["bench", artifact, "--baseline", tmp_path / "missing.json"], "not found", 1),
        (["bench", artifact, "--data", tmp_path / "nope"], "--data " + str(tmp_path / "nope") + ": not found", 1),
        (["bench", artifact, "--max-regression", "1.5"], "--max-regression must be a finite number in [0, 1)", 2),
        (["bench", tmp_path], "is not a corp-deploy artifact", 1),
    ]
    for args, message, status in cases:
        result, text = run_cli([*args, "--json", tmp_path / "r.json"], tmp_path / "state")
        assert result.exit_code == status and message in text and "Traceback" not in text, (args, text)
        assert not (tmp_path / "r.json").exists()
    moved = tmp_path / "copy"
    shutil.copytree(artifact, moved)
    config = json.loads((moved / "config.json").read_text())
    config["settings"]["seed"] = 99
    (moved / "config.json").write_text(json.dumps(config))
    for load in (lambda: resolve_target(moved / "export-fp32"), lambda: load_compressed(moved)):
        with pytest.raises(CorpError, match="config.json does not match the SHA-256"):
            load()
    # an export moved into another artifact is not taken for that artifact's export
    other = shutil.copytree(other_tiny_artifact, tmp_path / "other")
    shutil.copytree(artifact / "export-fp32", other / "export-fp32")
    with pytest.raises(CorpError, match="different version"):
        resolve_target(other)


def test_rows_say_how_they_were_timed(bench_run):
    """On the CPU device-resident and host-to-host timing are one measurement: each row is timed once,
    says so (``cpu``), and has no second figure; the reports say what the timing means."""
    report, out, text = bench_run
    assert report["settings"]["timing"] == "device-resident" and report["settings"]["cuda_graphs"] is False
    assert {row["timing"] for row in report["latency"]} == {"cpu"}
    assert not any("second" in row or "compile_s" in row for row in report["latency"])
    meaning = "cpu: on the CPU device-resident and host-to-host are one measurement, timed once"
    assert f"- {meaning}" in (out / "bench.md").read_text() and meaning in " ".join(text.split())
    assert "| torch-cpu | 1 | cpu |" in (out / "bench.md").read_text()


def test_a_format_1_report_still_reads_and_gates(bench_run):
    """Reports from before the timing was recorded timed every row host to host (on the CPU, its one
    measurement): they read, and gate a CPU run as before."""
    report, _, _ = bench_run
    old = copy.deepcopy(report)
    old["format_version"] = 1
    del old["settings"]["timing"], old["settings"]["cuda_graphs"]
    for row in old["latency"]:
        del row["timing"]
    typed = BenchReport.from_dict(old, "baseline")
    assert typed.settings.timing == "host-to-host"
    assert {row.timing for row in typed.latency} == {"cpu"}
    assert regressions(BenchReport.from_dict(report), GateLimits(max_regression=0.05), typed) == []
    cuda = {**old["latency"][0], "backend": "torch-cuda"}
    assert BenchReport.from_dict({**old, "latency": [cuda]}).latency[0].timing == "host-to-host"


def test_a_baseline_timed_the_other_way_is_refused(bench_run, artifact, tmp_path, run_cli):
    """A baseline whose GPU rows were timed host to host does not gate a device-resident run (and the
    reverse), as a baseline of another precision does not; asked for the same timing, the rows it has
    that this machine cannot measure fail the gate, never pass it."""
    report, _, _ = bench_run
    baseline = copy.deepcopy(report)
    cuda_row = {**copy.deepcopy(baseline["latency"][0]), "backend": "torch-cuda", "timing": "host-to-host"}
    baseline["latency"].append(cuda_row)
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(baseline))
    result, text = run_cli(["bench", artifact, *FAST, "--baseline", path, "--json", tmp_path / "r.json"], tmp_path)
    said = " ".join(text.split())
    assert result.exit_code == 1 and "Traceback" not in text, text
    assert "torch-cuda timed host-to-host in the baseline, device-resident here (--timing)" in said, text
    assert not (tmp_path / "r.json").exists()
    if not torch.cuda.is_available():
        args = [*FAST, "--timing", "host-to-host", "--baseline", path, "--json", tmp_path / "r.json"]
        result, text = run_cli(["bench", artifact, *args], tmp_path)
        assert result.exit_code == 4, text
        assert "latency: torch-cuda, batch 1 is in the baseline but was not measured" in " ".join(text.split())


def test_cuda_graphs_are_refused_where_they_cannot_run(artifact, tmp_path, run_cli):
    cases = [(["--backends", "ort", "--cuda-graphs"], "--cuda-graphs applies only with the torch backends")]
    if not torch.cuda.is_available():
        cases.append((["--backends", "torch", "--cuda-graphs"], "--cuda-graphs replays CUDA graphs on a CUDA GPU"))
    for args, message in cases:
        for command in (["bench", artifact], ["sweep", "deit_tiny", "--no-pretrained"]):
            result, text = run_cli([*command, *args, "-o", tmp_path / "out"], tmp_path)
            assert result.exit_code == 2 and message in " ".join(text.split()) and "Traceback" not in text, text
            assert not (tmp_path / "out").exists()


def test_reports_show_the_second_figure_and_compile_times(bench_run):
    """A GPU row: the figure gates use in the table, the other beside it, the compile apart."""
    report, _, _ = bench_run
    gpu = copy.deepcopy(report)
    row = gpu["latency"][0]
    second = {"timing": "host-to-host", **{key: copy.deepcopy(row[key]) for key in ("dense", "compressed", "speedup")}}
    second["dense"]["p50_s"], second["compressed"]["p50_s"] = 0.01168, 0.01109
    row.update(backend="torch-cuda", batch=64, timing="device-resident", second=second)
    row["compile_s"] = {"dense": 15.0, "compressed": 7.0}
    markdown = to_markdown(BenchReport.from_dict(gpu))
    assert "| torch-cuda | 64 | device-resident |" in markdown
    assert "- device-resident: images staged on the GPU once, outputs left there" in markdown
    assert "- torch-cuda, batch 64, host-to-host: dense 11.68 ms, compressed 11.09 ms, speedup" in markdown
    assert "- torch-cuda, batch 64: compiled in 15.0 s (dense) and 7.0 s (compressed)" in markdown
