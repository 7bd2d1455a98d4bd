"""`corp-deploy export` end to end: files, manifest, parity gates, the path without TensorRT, bad input."""

import hashlib
import json
import os
import stat
import subprocess

import numpy as np
import pytest
import torch

from corp_deploy import create_base_model, load_compressed
from corp_deploy.errors import EXIT_GATE_FAILED, EXIT_INCOMPLETE
from exporters import tensorrt as trt_backend
from exporters.manifest import read_manifest
from exporters.pipeline import PARITY_BATCHES, parity_images
from exporters.runners import OnnxRuntimeRunner
from tests.helpers import SMALL_VIT_CLI_ARGS, SMALL_VIT_KWARGS

NO_TENSORRT = trt_backend.unavailable_reason()


@pytest.fixture(scope="module")
def dense_export(tiny_artifact, tmp_path_factory, run_cli):
    out = tmp_path_factory.mktemp("export") / "out"
    result, text = run_cli(["export", tiny_artifact, "--dense", "-o", out], out.parent / "state")
    assert result.exit_code == 0, text
    return out, text


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_export_writes_checked_onnx_files_and_a_manifest(tiny_artifact, dense_export):
    out, text = dense_export
    assert sorted(p.name for p in out.iterdir()) == [
        "corp-deploy-record.json",
        "dense.onnx",
        "export.json",
        "model.onnx",
    ]
    assert "│ dense.onnx │ pytorch" in text and "fp32, dynamo exporter, opset 18" in text
    manifest = read_manifest(out).to_dict()
    assert manifest == json.loads((out / "export.json").read_text())  # the typed document is the file
    record = json.loads((out / "corp-deploy-record.json").read_text())
    assert sorted(record["files"]) == ["dense.onnx", "export.json", "model.onnx"]
    for name, entry in record["files"].items():
        assert entry["bytes"] == (out / name).stat().st_size and entry["sha256"] == sha256(out / name)
    assert manifest["artifact"]["weights_sha256"] == sha256(tiny_artifact / "model.safetensors")
    assert manifest["precision"] == "fp32" and manifest["exporter"] == "dynamo" and manifest["opset"] == 18
    assert manifest["inputs"] == [{"name": "images", "shape": ["batch", 3, 32, 32], "dtype": "float32"}]
    assert manifest["outputs"] == [{"name": "outputs", "shape": ["batch", 1000], "dtype": "float32"}]
    assert manifest["dynamic_axes"] == {"images": {"0": "batch"}, "outputs": {"0": "batch"}}
    assert {"torch", "onnx", "onnxruntime", "tensorrt", "polygraphy"} <= set(manifest["versions"])
    assert manifest["tensorrt"]["requested"] is False and manifest["tolerance"]["atol"] == 1e-4
    for name in ("model", "dense"):
        parity = manifest["models"][name]["parity"]["onnxruntime_vs_pytorch"]
        assert sorted(parity) == [f"batch_{b}" for b in sorted(PARITY_BATCHES)]
        for numbers in parity.values():
            assert numbers["max_abs"] < 1e-4 and numbers["cosine"] > 0.99999 and numbers["top1_agreement"] == 1
    models = manifest["models"]
    assert models["dense"]["macs"] > models["model"]["macs"] and models["dense"]["params"] > models["model"]["params"]


def test_exported_files_compute_what_the_models_compute(tiny_artifact, dense_export):
    """Independently of the gate: the compressed file against the artifact, the dense file
    against the same random dense model rebuilt from its seed, at a batch size not traced."""
    out, _ = dense_export
    x = parity_images(load_compressed(tiny_artifact), 3)
    dense = create_base_model("deit_tiny", SMALL_VIT_KWARGS, pretrained=False, seed=0)
    for name, model in (("model", load_compressed(tiny_artifact)), ("dense", dense)):
        with torch.no_grad():
            expected = model(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(OnnxRuntimeRunner(out / f"{name}.onnx").infer(x), expected, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def trt_export(tiny_artifact, tmp_path_factory, run_cli):
    out = tmp_path_factory.mktemp("trt") / "out"
    result, text = run_cli(
        [
            "export",
            tiny_artifact,
            "--trt",
            "--batch",
            "2:4:16",
            "--workspace",
            2,
            "--timing-cache",
            out.parent / "trt.cache",
            "-o",
            out,
        ],
        out.parent / "state",
    )
    return out, result, text


@pytest.mark.skipif(NO_TENSORRT is None, reason="TensorRT and a GPU are present: this tests the path without them")
def test_trt_without_tensorrt_writes_onnx_and_script_and_exits_3(trt_export):
    out, result, text = trt_export
    assert result.exit_code == EXIT_INCOMPLETE, text
    assert "TensorRT engines not built" in text and NO_TENSORRT in text
    assert "pip install 'corp-deploy[trt]'" in text and f"bash {out / 'build_engine.sh'}" in text
    assert sorted(p.name for p in out.iterdir()) == [
        "build_engine.sh",
        "corp-deploy-record.json",
        "export.json",
        "model.onnx",
    ]
    assert os.stat(out / "build_engine.sh").st_mode & stat.S_IXUSR
    manifest = read_manifest(out)
    assert manifest.tensorrt == {
        "requested": True,
        "built": False,
        "not_built_reason": NO_TENSORRT,
        "batch_profile": {"min": 2, "opt": 4, "max": 16},
        "workspace_gb": 2.0,
        "timing_cache": str((out.parent / "trt.cache").resolve()),
        "script": "build_engine.sh",
    }
    assert manifest.models["model"].engine is None
    record = json.loads((out / "corp-deploy-record.json").read_text())
    assert record["files"]["build_engine.sh"]["sha256"] == sha256(out / "build_engine.sh")


def fake_trtexec(folder, help_text):
    """A stand-in for trtexec that records its arguments (this tests the script, not TensorRT)."""
    folder.mkdir(exist_ok=True)
    stub = folder / "trtexec"
    stub.write_text(
        f'#!/usr/bin/env bash\nif [ "$1" = --help ]; then echo "{help_text}"; exit 0; fi\necho "$@" >> "$TRTEXEC_LOG"\n'
    )
    stub.chmod(0o755)
    return stub


@pytest.mark.parametrize("tensorrt_major", [10, 11])
def test_build_script_runs_trtexec_with_the_same_profile(trt_export, tmp_path, tensorrt_major):
    out, _, _ = trt_export
    help_text = "--stronglyTyped --noTF32" if tensorrt_major == 10 else "--noTF32"  # 11: always strongly typed
    fake_trtexec(tmp_path / "bin", help_text)
    log = tmp_path / "log"
    done = subprocess.run(
        ["bash", str(out / "build_engine.sh")],
        capture_output=True,
        text=True,
        env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "TRTEXEC_LOG": str(log)},
    )
    assert done.returncode == 0, done.stderr
    cache = (out.parent / "trt.cache").resolve()
    expected = (
        "--onnx=model.onnx --saveEngine=model.engine --minShapes=images:2x3x32x32 "
        "--optShapes=images:4x3x32x32 --maxShapes=images:16x3x32x32 --memPoolSize=workspace:2048M "
        f"--timingCacheFile={cache}" + (" --stronglyTyped" if tensorrt_major == 10 else "") + " --noTF32"
    )
    assert log.read_text().splitlines() == [expected]


def test_build_script_without_trtexec_says_what_to_install(trt_export):
    out, _, _ = trt_export
    done = subprocess.run(
        ["bash", str(out / "build_engine.sh")], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}
    )
    assert done.returncode == 127 and "trtexec not found: install TensorRT" in done.stderr


def test_failed_parity_gate_exits_4_with_the_numbers_and_writes_nothing(tiny_artifact, tmp_path, run_cli):
    result, text = run_cli(
        ["export", tiny_artifact, "--precision", "fp16", "--atol", 1e-6, "-o", tmp_path / "out"], tmp_path / "state"
    )
    assert result.exit_code == EXIT_GATE_FAILED, text
    assert "parity gate failed" in text and "max abs error" in text and "batch_8: max_abs=" in text
    assert "Traceback" not in text
    assert list(tmp_path.iterdir()) == []  # no output, no temporary directory


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a CUDA GPU, ONNX Runtime may check bf16 here")
def test_latest_artifact_default_directory_and_bf16_that_cannot_be_checked_here(tiny_artifact_copy, tmp_path, run_cli):
    art = tiny_artifact_copy
    state = tmp_path / "state"
    state.mkdir()
    (state / "latest.json").write_text(json.dumps({"artifact": str(art)}))
    result, text = run_cli(["export", "--precision", "bf16"], state)
    assert result.exit_code == EXIT_INCOMPLETE, text
    assert f"exporting the most recent artifact: {art}" in text and "no bfloat16 kernels" in text
    assert "ONNX Runtime's CUDA provider" in text and "corp-deploy[trt]" not in text  # what the check needs
    manifest = read_manifest(art / "export-bf16")
    assert "no bfloat16 kernels" in manifest.models["model"].parity["onnxruntime_vs_pytorch"]["skipped"]
    assert load_compressed(art) is not None  # the export inside does not disturb the artifact


def test_bad_inputs_give_one_message_and_leave_nothing(tiny_artifact, tmp_path, run_cli):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    out = tmp_path / "out"
    cases = [  # (exit status 2: a value refused as such; 1: what it names cannot be used)
        (["export", tmp_path / "missing"], "is not a corp-deploy artifact", 1),
        (["export"], "none recorded", 1),
        (["export", tiny_artifact, "--batch", "8:4:2"], "1 <= MIN <= OPT <= MAX", 2),
        (["export", tiny_artifact, "--batch", "big"], "--batch expects MIN:OPT:MAX", 2),
        (["export", tiny_artifact, "--opset", 12], "--opset must be between 17", 2),
        (["export", tiny_artifact, "--workspace", 0], "--workspace must be a number of GB from", 2),
        (["export", tiny_artifact, "--atol", -1], "--atol must be a finite number >= 0", 2),
        (["export", tiny_artifact, "--min-cosine", 2], "--min-cosine must be in [-1, 1]", 2),
        (["export", tiny_artifact, "--timing-cache", tmp_path / "nowhere" / "c"], "does not exist", 1),
        (["export", tiny_artifact, "--timing-cache", tmp_path / "c"], "apply only with --trt", 2),
        (["export", tiny_artifact, "--workspace", 2], "apply only with --trt", 2),
        (["export", tiny_artifact, "-o", foreign], "refusing to write an export to", 1),
    ]
    for args, message, status in cases:
        if "-o" not in args:
            args = [*args, "-o", out]
        result, text = run_cli(args, tmp_path / "state")
        assert result.exit_code == status, (args, text)
        assert message in text and "Traceback" not in text, (args, text)
        assert not out.exists()
    assert (foreign / "notes.txt").read_text() == "keep me" and len(list(foreign.iterdir())) == 1


def test_dense_export_refuses_a_changed_checkpoint(tmp_path, run_cli):
    from safetensors.torch import save_file

    dense = create_base_model("deit_tiny", SMALL_VIT_KWARGS, pretrained=False, seed=1)
    checkpoint = tmp_path / "dense.safetensors"
    save_file(dense.state_dict(), str(checkpoint))
    state = tmp_path / "state"
    result, text = run_cli(
        [
            "compress",
            "deit_tiny",
            *SMALL_VIT_CLI_ARGS,
            "--checkpoint",
            checkpoint,
            "--calib-samples",
            4,
            "-o",
            tmp_path / "art",
        ],
        state,
    )
    assert result.exit_code == 0, text
    save_file({k: v + 1 for k, v in dense.state_dict().items()}, str(checkpoint))
    result, text = run_cli(["export", tmp_path / "art", "--dense", "-o", tmp_path / "out"], state)
    assert result.exit_code == 1 and "has changed since" in text and not (tmp_path / "out").exists()
