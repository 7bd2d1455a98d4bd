"""Ordinary failures of the environment a command runs in, each one message and a non-zero exit,
never "internal error ... a bug" nor a library's own lines on the terminal: running out of memory
inside ONNX Runtime, a batch whose ONNX Runtime sessions cannot fit, a standard output whose encoding
cannot write what is printed, a full disk that a library reports without naming the file, and torch's
log lines at import. Cases in the style of ``tests/test_reliability.py`` (whose helpers they use)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from corp_deploy.outputs import verify_files
from tests.test_reliability import BASE, BENCH, assert_one_message, built, debris, invoke, setting, snapshot, work

__all__ = ["built", "work"]  # the fixtures of tests/test_reliability.py, requested below

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


# ---------------------------------------------------------------- memory


def test_onnx_runtime_running_out_of_memory_is_one_message_not_a_bug_report(work, monkeypatch):
    """ONNX Runtime raises its own exception type when its arena cannot allocate: that is running out
    of memory (how much, in which op), never "internal error"."""
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail

    import exporters.runners

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
    import benchmarks.pipeline

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
    from corp_deploy import load_compressed
    from corp_deploy.resources import onnxruntime_bytes
    from tests.helpers import build_small_vit

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
    from benchmarks.harness import onnxruntime_growth, probe_batches
    from corp_deploy import load_compressed
    from exporters.runners import OnnxRuntimeRunner
    from tests.helpers import build_small_vit

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
    import benchmarks.harness
    from benchmarks.pipeline import timing_bytes
    from benchmarks.results import BenchSettings
    from benchmarks.targets import find_target, load_models
    from corp_deploy.resources import check_fits

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
            cwd=Path(__file__).resolve().parents[1],
        )
        assert done.returncode == 0, done.stderr
        probe, extrapolated, held = map(int, done.stdout.split())
        assert probe < batch and abs(extrapolated - held) <= 0.3 * held, (graph, extrapolated, held)


# ---------------------------------------------------------------- printing


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
    import io

    from rich.console import Console

    import benchmarks.report

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


# ---------------------------------------------------------------- full disks

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
    import safetensors.torch

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
    import safetensors.torch

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


# ---------------------------------------------------------------- library log lines


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
    from corp_deploy.cli.group import _failure
    from corp_deploy.outputs import NotedOutputs

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
