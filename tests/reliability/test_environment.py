"""Ordinary failures of the environment a command runs in, each one message and a non-zero exit,
never "internal error ... a bug" nor a library's own lines on the terminal: standard streams closed,
full or unable to encode, no home for the state, memory (torch's and ONNX Runtime's) and disk
running out, a library that cannot be loaded or is missing, narrow terminals."""

from __future__ import annotations

import errno
import io
import json
import os
import re
import shutil
import shutil as shell
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch
from click.testing import CliRunner
from onnxruntime.capi.onnxruntime_pybind11_state import Fail
from rich.console import Console

import benchmarks.harness
import benchmarks.pipeline
import benchmarks.report
import exporters.pipeline
import exporters.runners
from benchmarks.harness import onnxruntime_growth, probe_batches
from benchmarks.pipeline import timing_bytes
from benchmarks.results import BenchSettings
from benchmarks.targets import find_target, load_models
from corp_deploy import load_compressed, resources
from corp_deploy.cli import cli
from corp_deploy.cli.group import _failure
from corp_deploy.latest import state_dir
from corp_deploy.outputs import NotedOutputs, verify_files
from corp_deploy.resources import check_fits, onnxruntime_bytes
from exporters.runners import OnnxRuntimeRunner
from tests.helpers import build_small_vit
from tests.reliability.common import BASE, BENCH, assert_one_message, debris, image_folder, invoke, setting, snapshot


@pytest.fixture
def nobody_reads():
    """The write end of a pipe whose read end is closed already: a reader gone before the child starts,
    so that every write of the child to it fails, its first one included."""
    read, write = os.pipe()
    os.close(read)
    yield write
    os.close(write)


def test_a_closed_standard_output_after_the_artifact_is_written_says_the_artifact_is_complete(tmp_path, nobody_reads):
    """``corp-deploy compress ... | head -0``: the summary cannot be printed once the artifact is in
    place. The message says the artifact is complete and what failed, with its own exit status
    (5), never "nothing partial was left behind"; no traceback and no failing flush at exit."""
    done = subprocess.run(
        [sys.executable, "-m", "corp_deploy.launch", *BASE, "-o", str(tmp_path / "art")],
        stdout=nobody_reads,  # the reader went away before the summary
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "CORP_DEPLOY_STATE_DIR": str(tmp_path / "state")},
    )
    stderr = done.stderr
    assert done.returncode == 5, stderr
    assert f"{tmp_path / 'art'} is complete (written before the failure), but a later step failed: " in stderr
    assert "printing the results on the standard output failed (Broken pipe)" in stderr
    assert "nothing partial" not in stderr and "Traceback" not in stderr and "Exception ignored" not in stderr
    assert stderr.count("Error:") == 1, stderr
    verify_files(tmp_path / "art", "artifact")


def test_a_standard_output_closed_from_the_start_is_a_failed_print_not_a_silent_one(tmp_path):
    """``corp-deploy compress ... >&-``: Python starts with no ``sys.stdout`` and ``print`` would
    write nowhere; the run says its artifact is complete and that printing failed (exit 5), and the
    group's own --help fails with one line."""
    env = {**os.environ, "CORP_DEPLOY_STATE_DIR": str(tmp_path / "state")}
    closed = {"preexec_fn": lambda: os.close(1), "stderr": subprocess.PIPE, "text": True, "cwd": tmp_path, "env": env}
    done = subprocess.run([sys.executable, "-m", "corp_deploy.launch", *map(str, BASE), "-o", "art"], **closed)
    assert done.returncode == 5, done.stderr
    assert f"{tmp_path / 'art'} is complete (written before the failure), but a later step failed: " in done.stderr
    assert "printing the results on the standard output failed (standard output is closed)" in done.stderr
    verify_files(tmp_path / "art", "artifact")
    done = subprocess.run([sys.executable, "-m", "corp_deploy.launch", "--help"], **closed)
    assert done.returncode == 1 and done.stderr.strip() == (
        "corp-deploy: printing on the standard output failed (standard output is closed)"
    ), done.stderr


def test_a_batch_that_cannot_fit_in_memory_is_refused_before_the_work(work, monkeypatch):
    """bench's timing batch and recovery's training batch are checked against the memory available
    (lower bounds: the batch, the activations a step must hold) before any image is read."""

    monkeypatch.setattr(resources, "available_bytes", lambda: 60 * 2**20)  # 60 MiB; recovery needs 100 MB
    args = ["bench", work / "art", *setting(BENCH, "--batch", 8192)]
    code, text, exception = invoke(args, work.parent / "state")
    assert_one_message(code, text, exception, 1, "timing at batch 8192 needs at least")
    args = [*BASE, "--recover-steps", 2, "--recover-batch-size", 4096, "-o", work / "o"]
    code, text, exception = invoke(args, work.parent / "state")
    assert_one_message(code, text, exception, 1, "recovering at 4096 images per step needs at least")
    assert "--recover-checkpointing" in text and not (work / "o").exists()


def test_a_standard_error_that_cannot_be_written_does_not_stop_the_work(tmp_path, nobody_reads):
    """``compress ... 2>/dev/full`` (here: a pipe whose reader went away): progress and warnings
    that cannot be written are dropped, as for a closed standard error, and the command does its job."""
    done = subprocess.run(
        [sys.executable, "-m", "corp_deploy.launch", *map(str, BASE), "-o", "art"],
        stdout=subprocess.PIPE,
        stderr=nobody_reads,  # nobody reads the diagnostics
        text=True,
        cwd=tmp_path,
        env={**os.environ, "CORP_DEPLOY_STATE_DIR": str(tmp_path / "state")},
    )
    assert done.returncode == 0
    assert "corp-deploy compress" in done.stdout
    verify_files(tmp_path / "art", "artifact")


def test_a_failure_after_the_reports_are_written_says_they_are_complete(work, monkeypatch):
    """bench: the reports are in place when printing the table fails (a full disk behind stdout):
    exit 5, naming the reports as complete."""

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(benchmarks.report, "print_terminal", full)
    args = ["bench", work / "art", *BENCH, "--backends", "torch", "--json", work / "r.json", "-o", work / "b"]
    code, text, exception = invoke(args, work.parent / "state")
    assert_one_message(code, text, exception, 5, "are complete (written before the failure), but a later step failed")
    assert "printing the results on the standard output failed (No space left on device)" in text
    assert str(work / "r.json") in text and str(work / "b") in text and "nothing partial" not in text
    verify_files(work / "b", "bench")
    assert json.loads((work / "r.json").read_text())["format"] == "corp-deploy-bench"


def test_a_failed_state_write_does_not_fail_a_run_that_succeeded(work):
    blocker = work.parent / "state-file"
    blocker.write_text("not a directory")
    result = CliRunner().invoke(
        cli, [str(a) for a in [*BASE, "-o", work / "o"]], env={"CORP_DEPLOY_STATE_DIR": str(blocker / "state")}
    )
    assert result.exit_code == 0, result.output
    assert "warning: could not record" in result.output and load_compressed(work / "o") is not None


def test_without_a_home_no_state_is_kept_and_the_commands_say_so(tmp_path, built, monkeypatch):
    """``HOME`` empty, relative or unset (and no ``XDG_STATE_HOME`` or ``CORP_DEPLOY_STATE_DIR``):
    no state folder (never ``/.local/state`` at the file system's root); compress warns that it
    keeps no record and completes, a command without an artifact says why it has none."""

    monkeypatch.delenv("CORP_DEPLOY_STATE_DIR", raising=False)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    for home in ("", "relative/home", None):
        if home is None:
            monkeypatch.delenv("HOME")
        else:
            monkeypatch.setenv("HOME", home)
        assert state_dir() is None
    unset = {"CORP_DEPLOY_STATE_DIR": None, "XDG_STATE_HOME": None, "HOME": ""}
    result = CliRunner().invoke(cli, [str(a) for a in [*BASE, "-o", tmp_path / "art"]], env=unset)
    said = " ".join(result.output.split())
    assert result.exit_code == 0 and "keeps no record of the most recent artifact: pass" in said, result.output
    result = CliRunner().invoke(cli, ["export"], env=unset)
    assert_one_message(result.exit_code, result.output, result.exception, 1, "pass the artifact directory")
    assert "keeps no record" in result.output


def test_a_run_that_cannot_fit_in_memory_is_refused_before_the_work(work, monkeypatch):
    monkeypatch.setattr("corp_deploy.resources.available_bytes", lambda: 1024)  # a machine with 1 KiB free
    three = image_folder(work.parent / "three", 3)
    for args, what in (
        ([*BASE, "-o", work / "o"], "compressing deit_tiny_patch16_224 on 4 images"),
        (  # the files alone: at most 10**7 asked for, the 3 there are counted
            [*BASE[:-2], "--calib", three, "--calib-samples", 10**7, "--no-calib-crops", "-o", work / "o"],
            "compressing deit_tiny_patch16_224 on 3 images",
        ),
        (  # filled with crops of the 3: every image asked for is counted
            [*BASE[:-2], "--calib", three, "--calib-samples", 10**7, "-o", work / "o"],
            "compressing deit_tiny_patch16_224 on 10000000 images",
        ),
        (["export", work / "art", "-o", work / "o"], "the export"),
        (["bench", work / "art", *BENCH], "timing at batch 1"),
    ):
        before = snapshot(work)
        code, text, exception = invoke(args, work.parent / "state")
        assert_one_message(code, text, exception, 1, f"{what} needs at least")
        assert "GiB are available" in text and snapshot(work) == before


def test_running_out_of_memory_or_disk_is_one_message_not_a_bug_report(work, monkeypatch):

    failures = {
        "memory": RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 123 bytes"
        ),
        "disk": OSError(errno.ENOSPC, "No space left on device", "model.safetensors"),
    }
    for kind, failure in failures.items():

        def fail(*args, **kwargs):
            raise failure

        monkeypatch.setattr(safetensors.torch, "save_file", fail)
        before = snapshot(work)
        code, text, exception = invoke([*BASE, "-o", work / "o"], work.parent / "state")
        message = "ran out of memory" if kind == "memory" else "the file system refused: No space left on device"
        assert_one_message(code, text, exception, 1, message)
        assert "bug" not in text and snapshot(work) == before and not debris(work)


def _exporter_error_from_a_full_disk() -> Exception:

    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as cause:
        try:
            raise torch.onnx.OnnxExporterError("Failed to export the model to ONNX") from cause
        except torch.onnx.OnnxExporterError as error:
            return error


#: How libraries report a full disk in their own exception types: the failure, and the command
#: whose write raises it (compress saving the weights, export the graph).
LIBRARY_DISK_FAILURES = {
    "safetensors": (
        lambda: __import__("safetensors").SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        ),
        "compress",
    ),
    "torch-stream-writer": (
        lambda: RuntimeError(
            "[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file data/0: "
            "file write failed"
        ),
        "compress",
    ),
    "onnx-exporter-raised-from-the-os-error": (_exporter_error_from_a_full_disk, "export"),
}


@pytest.mark.parametrize("library", sorted(LIBRARY_DISK_FAILURES))
def test_a_full_disk_inside_a_library_is_one_plain_message(work, monkeypatch, library):
    """A full disk reported by a library in its own exception type is the file system's refusal,
    never "internal error ... a bug"; nothing is left."""

    failure, command = LIBRARY_DISK_FAILURES[library]

    def fail(*args, **kwargs):
        raise failure()

    if command == "compress":
        monkeypatch.setattr(safetensors.torch, "save_file", fail)
        args = [*BASE, "-o", work / "o"]
    else:
        monkeypatch.setattr(exporters.pipeline, "export_onnx", fail)
        args = ["export", work / "art", "-o", work / "o"]
    before = snapshot(work)
    code, text, exception = invoke(args, work.parent / "state")
    assert_one_message(code, text, exception, 1, "the file system refused: ")
    assert ("No space left on device" in text or "the disk may be full" in text) and "bug" not in text, text
    assert snapshot(work) == before and not debris(work)


def test_the_disk_check_counts_the_old_output_that_stays_until_the_swap(work, monkeypatch):
    """Replacing an artifact: the old one keeps its room until the new one is complete, so the free
    space must hold the whole new artifact; refused before anything is written, naming both."""

    real = shell.disk_usage
    weights = (work / "art" / "model.safetensors").stat().st_size
    monkeypatch.setattr(shell, "disk_usage", lambda path: real(path)._replace(free=weights // 2))
    before = snapshot(work)
    code, text, exception = invoke([*BASE, "-o", work / "art"], work.parent / "state")
    assert_one_message(code, text, exception, 1, "of disk in")
    assert "both need room at once" in text and snapshot(work) == before and not debris(work)


def test_a_dependency_missing_from_the_installation_is_named_not_reported_as_a_bug(work, monkeypatch):
    # Seen on a GPU machine whose Polygraphy wheel went to another interpreter: export and bench
    # ended with "internal error ... this is a bug in corp-deploy".
    monkeypatch.setitem(sys.modules, "polygraphy", None)  # `import polygraphy` now raises ModuleNotFoundError
    before = snapshot(work)
    code, text, exception = invoke(["export", work / "art", "-o", work / "o"], work.parent / "state")
    assert_one_message(code, text, exception, 1, "the Python module 'polygraphy' is not installed")
    assert "bug" not in text and snapshot(work) == before and not debris(work)


@pytest.mark.parametrize("exporter", [["--exporter", "torchscript"], ["--opset", "17"]])
def test_library_warnings_stay_off_the_terminal(tmp_path, built, exporter):
    """The exporters, timm and ONNX Runtime warn a lot (the dynamo exporter logs that it converts
    opset 18 down to 17); through the command only corp-deploy speaks."""
    shutil.copytree(built / "art", tmp_path / "art")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "corp_deploy.launch",
            "export",
            str(tmp_path / "art"),
            "--dense",
            *exporter,
            "-o",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "CORP_DEPLOY_STATE_DIR": str(tmp_path / "state")},
    )
    assert done.returncode == 0, done.stderr
    assert not re.search(r"warn|deprecat", done.stderr, flags=re.I), done.stderr


#: The message ONNX Runtime 1.31 raises (as ``onnxruntime.capi.onnxruntime_pybind11_state.Fail``) when its
#: CPU arena cannot allocate, as seen in ``bench --backends ort --batch 65536`` under ``ulimit -v``.
ORT_ALLOCATION_FAILURE = (
    "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Add node. Name:'node_linear' "
    "Status Message: /onnxruntime_src/onnxruntime/core/framework/bfc_arena.cc:360 void* "
    "onnxruntime::BFCArena::AllocateRawInternal(size_t, bool, onnxruntime::Stream*) Failed to allocate memory "
    "for requested buffer of size 641728512\n"
)


def _child_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "CORP_DEPLOY_STATE_DIR": str(tmp_path / "state"), **extra}


def test_onnx_runtime_running_out_of_memory_is_one_message_not_a_bug_report(work, monkeypatch):
    """ONNX Runtime raises its own exception type when its arena cannot allocate: that is running out
    of memory (how much, in which op), never "internal error"."""

    def fail(self, images):
        raise Fail(ORT_ALLOCATION_FAILURE)

    monkeypatch.setattr(exporters.runners.OnnxRuntimeRunner, "_infer", fail)
    before = snapshot(work)
    args = ["bench", work / "art", "--backends", "ort", *BENCH, "--json", work / "r.json"]
    code, text, exception = invoke(args, work.parent / "state")
    assert_one_message(
        code,
        text,
        exception,
        1,
        "ran out of memory (ONNX Runtime could not allocate 612 MiB while running its Add node)",
    )
    assert "bug" not in text and "bfc_arena" not in text and snapshot(work) == before and not debris(work)


def test_a_batch_whose_onnx_runtime_sessions_cannot_fit_is_refused_before_the_work(work, monkeypatch):
    """bench with ONNX Runtime holds the input batch and both sessions' working memory at once (each
    arena keeps what it allocated): for the small ViT (17 tokens, width 48, MLP 192, 3 heads) at least
    12288 + 26112 (dense: the MLP's GELU, in and out) + 13056 (compressed, half the MLP) bytes an image,
    more than eager PyTorch's 12288 + 26112. Between the two, only ONNX Runtime's timing is refused,
    before any image is read."""

    def reached(*args, **kwargs):
        raise RuntimeError("the work began")  # an internal error, should the pre-check let the batch through

    monkeypatch.setattr(benchmarks.pipeline, "eval_images", reached)
    batch = 8192
    monkeypatch.setattr("corp_deploy.resources.available_bytes", lambda: 45_000 * batch)
    args = ["bench", work / "art", *setting(BENCH, "--batch", batch)]
    code, text, exception = invoke([*args, "--backends", "ort"], work.parent / "state")
    assert_one_message(code, text, exception, 1, f"timing at batch {batch} needs at least 0.4 GiB")
    code, text, _ = invoke([*args, "--backends", "torch"], work.parent / "state")
    assert code == 1 and "the work began" in text, text  # eager PyTorch's bound fits: the run went on


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident memory from /proc")
def test_the_onnx_runtime_bound_stays_below_what_a_session_really_holds(built):
    """The bound is a lower bound: one run of each exported graph of the small ViT at batch 256, in a
    child process, adds more resident memory than it says (measured: about 4x)."""

    batch, size = 256, (3, 32, 32)
    measure = textwrap.dedent(
        """
        import sys, numpy as np, onnxruntime as ort
        options = ort.SessionOptions()
        options.log_severity_level = 4
        session = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
        x = np.random.default_rng(0).standard_normal((int(sys.argv[2]), 3, 32, 32), dtype=np.float32)
        def resident():
            return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:"))
        before = resident()
        session.run(None, {session.get_inputs()[0].name: x})
        print(resident() - before)
        """
    )
    export = built / "art" / "export-fp32"
    for graph, model in (("dense.onnx", build_small_vit()), ("model.onnx", load_compressed(built / "art"))):
        done = subprocess.run(
            [sys.executable, "-c", measure, str(export / graph), str(batch)], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        held, bound = int(done.stdout), onnxruntime_bytes(model, size, batch)
        assert 0 < bound < held, (graph, bound, held)


def _measured_timing_bytes(export: Path, batch: int) -> int:
    """What bench's measurement (:func:`benchmarks.harness.check_onnxruntime_timing`) counts for
    timing the small ViT's two exported graphs at ``batch`` with ONNX Runtime, measured here: each
    session's memory at its two probe batches, extrapolated, and the input batch."""

    size, total = (3, 32, 32), batch * 4 * 3 * 32 * 32
    for graph, model in (("dense.onnx", build_small_vit()), ("model.onnx", load_compressed(export.parent))):
        with OnnxRuntimeRunner(export / graph) as runner:
            total += onnxruntime_growth(runner, probe_batches(model, size), size).at(batch)
    return total


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident memory from /proc")
def test_onnx_runtime_timing_is_refused_by_its_measured_memory_where_the_bound_lets_it_through(work, monkeypatch):
    """The lower bound (:func:`~corp_deploy.resources.onnxruntime_bytes`) lets a batch through that ONNX
    Runtime's sessions, measured at two small batches and extrapolated per image, cannot hold: with the
    memory available between the two (both measured here), bench refuses it once its sessions are open,
    before anything is timed, and writes nothing."""

    batch = 8192
    artifact, export_dir = find_target(work / "art")
    compressed, dense = load_models(artifact, export_dir)
    bound = timing_bytes(dense, compressed, (3, 32, 32), BenchSettings(backends=("ort",), batches=(batch,)))
    measured = _measured_timing_bytes(work / "art" / "export-fp32", batch)
    assert 2 * bound < measured, (bound, measured)  # measured: about 6x (298 KB an image against 51 KB)
    available = (bound + measured) // 2
    monkeypatch.setattr("corp_deploy.resources.available_bytes", lambda: available)
    check_fits("the bound", bound, "")  # the old pre-check lets the batch through

    def timed(*args, **kwargs):
        raise RuntimeError("timing began")

    monkeypatch.setattr(benchmarks.harness, "interleaved", timed)
    before = snapshot(work)
    args = ["bench", work / "art", *setting(BENCH, "--batch", batch), "--backends", "ort", "--json", work / "r.json"]
    code, text, exception = invoke(args, work.parent / "state")
    assert_one_message(code, text, exception, 1, f"timing at batch {batch} needs at least")
    assert "timing began" not in text and "use smaller --batch sizes" in text, text
    assert snapshot(work) == before and not debris(work)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident memory from /proc")
def test_the_measured_onnx_runtime_memory_extrapolates_to_what_a_larger_batch_holds(built):
    """In a child process, each exported graph of the small ViT measured at its probe batches and
    extrapolated to batch 8192 is within 30% of what its session then holds after two runs at 8192
    (measured: within 1%)."""
    measure = textwrap.dedent(
        """
        import sys
        import numpy as np
        from benchmarks.harness import onnxruntime_growth, probe_batches
        from corp_deploy import load_compressed
        from corp_deploy.resources import resident_bytes, resident_peak
        from exporters.runners import OnnxRuntimeRunner
        from tests.helpers import build_small_vit

        graph, batch, size = sys.argv[1], int(sys.argv[2]), (3, 32, 32)
        model = build_small_vit() if graph.endswith("dense.onnx") else load_compressed(sys.argv[3])
        probes = probe_batches(model, size)
        x = np.random.default_rng(1).standard_normal((batch, *size), dtype=np.float32)
        runner = OnnxRuntimeRunner(graph)
        runner.infer(x[:1])
        before = resident_bytes()
        grown = onnxruntime_growth(runner, probes, size)
        held = resident_peak(lambda: (runner.infer(x), runner.infer(x))) - before
        print(probes[1], grown.at(batch), held)
        """
    )
    export, batch = built / "art" / "export-fp32", 8192
    for graph in ("dense.onnx", "model.onnx"):
        done = subprocess.run(
            [sys.executable, "-c", measure, str(export / graph), str(batch), str(built / "art")],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert done.returncode == 0, done.stderr
        probe, extrapolated, held = map(int, done.stdout.split())
        assert probe < batch and abs(extrapolated - held) <= 0.3 * held, (graph, extrapolated, held)


def test_a_standard_output_that_cannot_encode_the_results_is_a_failed_print_not_a_bug(tmp_path):
    """``PYTHONIOENCODING=ascii corp-deploy compress ... -o ärt``: the summary names the artifact, which
    ASCII cannot write. The artifact is complete (exit 5) and the message says which character, in
    which encoding, and what to set; no traceback, nothing printed half."""
    done = subprocess.run(
        [sys.executable, "-m", "corp_deploy.launch", *BASE, "-o", "ärt"],
        capture_output=True,
        cwd=tmp_path,
        env=_child_env(tmp_path, PYTHONIOENCODING="ascii"),
    )
    stderr = done.stderr.decode("utf-8", "backslashreplace")
    assert done.returncode == 5, stderr
    assert "is complete (written before the failure), but a later step failed: printing the results on the " in stderr
    assert "standard output failed (its encoding, ascii, cannot write " in stderr and "(U+00E4)" in stderr
    assert "set PYTHONIOENCODING=utf-8 or use a UTF-8 locale" in stderr
    assert "bug" not in stderr and "Traceback" not in stderr and stderr.count("Error:") == 1, stderr
    verify_files(tmp_path / "ärt", "artifact")


def test_a_narrow_ascii_terminal_gets_the_whole_bench_table(work):
    """``PYTHONIOENCODING=ascii COLUMNS=60 corp-deploy bench ...``: rich cut the speedup column's
    "(p10-p90)" with "…", which ASCII cannot write, so the run failed on its own table. Cells now
    wrap: exit 0, nothing but ASCII, no cut cell."""
    args = ["bench", "art", "--backends", "torch,ort", *BENCH]
    done = subprocess.run(
        [sys.executable, "-m", "corp_deploy.launch", *args],
        capture_output=True,
        cwd=work,
        env=_child_env(work.parent, PYTHONIOENCODING="ascii", COLUMNS="60"),
    )
    stderr = done.stderr.decode("utf-8", "backslashreplace")
    assert done.returncode == 0, stderr
    assert done.stdout.isascii() and b"speedup" in done.stdout and b"..." not in done.stdout, done.stdout


def test_a_narrow_terminal_wraps_every_table_cell_and_loses_no_digit(work, monkeypatch):
    """The bench report rendered 50 columns wide holds every digit the 250-columns one does: a cell too
    wide for its column wraps onto the next line, never ends in "…" (a p90 cut to "2.8…")."""

    reports, print_terminal = [], benchmarks.report.print_terminal
    monkeypatch.setattr(benchmarks.report, "print_terminal", lambda report, console=None: reports.append(report))
    code, text, _ = invoke(["bench", work / "art", "--backends", "torch,ort", *BENCH], work.parent / "state")
    assert code == 0 and len(reports) == 1, text

    def digits(width: int) -> list[str]:
        out = io.StringIO()
        print_terminal(reports[0], Console(file=out, width=width))
        assert "\u2026" not in out.getvalue(), out.getvalue()
        return sorted(character for character in out.getvalue() if character.isdigit())

    assert digits(50) == digits(250)


#: Ways a full disk reaches the command, as ``(the failure, what the message must say)`` given the
#: case's output and temporary directory: a library's own exception type that names no file
#: (safetensors), and an OS error naming a file in the temporary directory.
DISK_FAILURES = {
    "safetensors-names-no-file": (
        lambda out, temp: __import__("safetensors").SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        ),
        lambda out, temp: f"No space left on device (reported by safetensors) while writing {out}; nothing partial",
    ),
    "a-file-in-the-temporary-directory": (
        lambda out, temp: OSError(errno.ENOSPC, "No space left on device", str(temp / "spool.npy")),
        lambda out, temp: (
            f"while writing {out}; the file was in the temporary directory $TMPDIR ({temp}) (free "
            "space there, or point TMPDIR at a larger disk)"
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(DISK_FAILURES))
def test_a_full_disk_names_the_output_being_written(work, monkeypatch, case):
    """The file system's refusal names the output the command was writing, and the temporary directory
    ($TMPDIR, with its path) when the refused file lay there; nothing is left."""

    failure, message = DISK_FAILURES[case]
    out, temp = work / "o", Path(tempfile.gettempdir())

    def fail(*args, **kwargs):
        raise failure(out, temp)

    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    before = snapshot(work)
    code, text, exception = invoke([*BASE, "-o", out], work.parent / "state")
    assert_one_message(code, text, exception, 1, "the file system refused: No space left on device")
    assert message(out, temp) in " ".join(text.split()), text
    assert "bug" not in text and snapshot(work) == before and not debris(work)


def test_a_full_temporary_directory_is_named_as_tmpdir_when_the_library_names_no_file(work, monkeypatch):
    """The write that failed named no file, but the temporary directory's file system is the one left
    full when the output was abandoned (before its cleanup): the message says so, naming $TMPDIR and
    its path, and what to do."""

    temp, real = Path(tempfile.gettempdir()), shutil.disk_usage

    def fail(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: real(path)._replace(free=0) if Path(path) == temp else real(path)
    )
    code, text, exception = invoke([*BASE, "-o", work / "o"], work.parent / "state")
    assert_one_message(code, text, exception, 1, f"while writing {work / 'o'}")
    said = " ".join(text.split())
    assert f"the file system of the temporary directory $TMPDIR ({temp}) is full" in said, text
    assert "point TMPDIR at a larger disk" in said and f"the file system of {work}" not in said and not debris(work)


def _patched_inductor_bench(artifact: Path) -> str:
    """A child script: ``corp-deploy bench ARTIFACT --backends torch-compile`` through the entry point,
    where each compile only imports what inductor imports first (``torch.utils.cpp_extension``, which
    logs "No CUDA runtime is found, using CUDA_HOME=..." where CUDA_HOME is set and no GPU is seen)
    and the compiled forward is the eager one: the warning is torch's own, at its own moment, without
    minutes of compiling."""
    return textwrap.dedent(
        f"""
        import importlib, sys
        from exporters import torch_compile

        def compile_only_imports(self, shape):
            importlib.import_module("torch.utils.cpp_extension")
            return 1e-3

        torch_compile.CompiledTorchRunner._compile = compile_only_imports
        torch_compile.CompiledTorchRunner._run = lambda self, x: self.model(x)
        sys.argv = ["corp-deploy", "bench", {str(artifact)!r}, "--backends", "torch-compile", *{BENCH!r}]
        from corp_deploy.launch import main
        main()
        """
    )


def test_torchs_log_lines_stay_off_the_terminal(built, tmp_path):
    """torch gives its loggers a handler of their own on standard error: the entry point keeps every
    library's log records below ERROR off the terminal whatever their levels and handlers, while
    corp-deploy's own progress lines still show. The control run proves the environment triggers it."""
    env = _child_env(tmp_path, CUDA_HOME=str(tmp_path), CUDA_VISIBLE_DEVICES="")  # a CUDA_HOME, no GPU
    warning = "No CUDA runtime is found, using CUDA_HOME="
    control = subprocess.run(
        [sys.executable, "-c", "import torch.utils.cpp_extension"], capture_output=True, text=True, env=env
    )
    assert warning in control.stderr, control.stderr  # torch logs it on import, outside corp-deploy
    done = subprocess.run(
        [sys.executable, "-c", _patched_inductor_bench(built / "art")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "torch-compile: compiling each model" in done.stderr  # corp-deploy's own lines still show
    assert warning not in done.stderr and "cpp_extension" not in done.stderr, done.stderr


@pytest.mark.slow  # about 2 minutes on 2 shared cores: inductor compiles two models at two shapes
@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor compiles the CPU's kernels with g++")
def test_a_real_torch_compile_bench_prints_no_torch_log_lines(built, tmp_path):
    """The whole ``bench --backends torch-compile`` with inductor really compiling, CUDA_HOME set and no GPU."""
    done = subprocess.run(
        [sys.executable, "-m", "corp_deploy.launch", "bench", built / "art", "--backends", "torch-compile", *BENCH],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_child_env(tmp_path, CUDA_HOME=str(tmp_path), CUDA_VISIBLE_DEVICES=""),
    )
    assert done.returncode == 0, done.stderr
    assert "No CUDA runtime" not in done.stderr and "torch/" not in done.stderr, done.stderr


def test_a_refused_file_names_where_it_was_and_only_then_the_output_being_written(tmp_path):
    """Which output a refused write belongs to, by the file the OS error names: one in the output's
    staging folder, or a name without a folder (``model.safetensors``), is the output's; one anywhere
    else (an input the command reads) is not said to be."""

    out, staging = tmp_path / "o", tmp_path / ".o.tmp-1"
    noted = NotedOutputs(abandoned=[(out, False, staging)])
    for filename, names_the_output in (
        (str(staging / "model.safetensors"), True),
        ("model.safetensors", True),
        (str(tmp_path / "images" / "a.png"), False),
    ):
        message, code = _failure(OSError(errno.EACCES, "Permission denied", filename), False, "compress", noted)
        assert code == 1 and message.startswith(f"the file system refused: Permission denied ({filename})")
        assert (f"while writing {out};" in message) == names_the_output, message


UNLOADABLE = """
import sys
class Hook:  # what a low ``ulimit -v`` does to torch's shared libraries, at the import every command makes
    def find_spec(self, name, path, target=None):
        if name == "timm":
            raise ImportError("libtorch_cuda.so: failed to map segment from shared object")
sys.meta_path.insert(0, Hook())
sys.argv = ["corp-deploy", *sys.argv[1:]]
from corp_deploy.launch import main
main()
"""


def test_libraries_that_cannot_be_loaded_are_one_message_not_a_traceback(tmp_path):
    """``ulimit -v 600000; corp-deploy ...``: torch's libraries cannot be mapped (an ImportError while the
    libraries load, before any command runs): one line saying so and what to check, exit 1, nothing written."""
    done = subprocess.run(
        [sys.executable, "-c", UNLOADABLE, *map(str, BASE), "-o", "art"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "CORP_DEPLOY_STATE_DIR": str(tmp_path / "state")},
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == (
        "corp-deploy: its libraries could not be loaded (ImportError: libtorch_cuda.so: failed to map segment "
        "from shared object): a memory limit too low for them (ulimit -v), or an installation to repair"
    ), done.stderr
    assert list(tmp_path.iterdir()) == []
