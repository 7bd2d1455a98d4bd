"""It never leaves half an output when it is stopped: every signal that ends a process by default is
an interrupt; a real corp-deploy process signalled at a named point (the FAULTS table) keeps the
previous output intact and leaves no staging or temporary folder; a signal while the libraries
load stops the run cleanly."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

from corp_deploy import load_compressed
from corp_deploy.interrupts import INTERRUPTS, signal_name
from corp_deploy.outputs import staged_output, verify_files
from tests.helpers import AS_A_FOREGROUND_JOB
from tests.reliability.common import BASE, BENCH, debris, invoke, snapshot

FAULT_RUNNER = """
import os, signal, sys, importlib
module = importlib.import_module(sys.argv[1])
name, call = sys.argv[2], int(sys.argv[3])
base, _, offset = sys.argv[4].partition("+")  # SIGTERM, or a real-time signal: SIGRTMIN+2
signum = getattr(signal, base) + int(offset or 0)
signal.signal(signum, signal.SIG_DFL)  # as in a shell's foreground job, whatever this test was started with
original, calls = getattr(module, name), [0]
def patched(*args, **kwargs):
    calls[0] += 1
    if calls[0] == call:
        os.kill(os.getpid(), signum)
    return original(*args, **kwargs)
setattr(module, name, patched)
sys.argv = ["corp-deploy", *sys.argv[5:]]
from corp_deploy.launch import main
main()
"""


class Fault(NamedTuple):
    """Send ``signal`` to the run when ``module.function`` is called the ``call``-th time."""

    module: str
    function: str
    call: int
    signal: str
    args: Callable[[Path], list]
    output: str


FAULTS = {
    "compress-sigterm-while-calibrating": Fault(
        "corp_deploy.engine", "embed_tokens", 2, "SIGTERM", lambda w: [*BASE, "-o", w / "art"], "art"
    ),
    "compress-sigint-while-saving-the-weights": Fault(
        "safetensors.torch", "save_file", 1, "SIGINT", lambda w: [*BASE, "-o", w / "art"], "art"
    ),
    "compress-sigint-while-saving-into-new-folders": Fault(
        "safetensors.torch", "save_file", 1, "SIGINT", lambda w: [*BASE, "-o", w / "new" / "deeper" / "art"], "new"
    ),
    "compress-sigterm-while-the-output-is-swapped": Fault(
        "os", "rename", 1, "SIGTERM", lambda w: [*BASE, "--seed", 5, "-o", w / "art"], "art"
    ),
    "compress-sigterm-while-recovering": Fault(
        "corp_deploy.recovery.training",
        "distillation_loss",
        2,
        "SIGTERM",
        lambda w: [*BASE, "--recover-steps", 4, "--recover-batch-size", 2, "-o", w / "art"],
        "art",
    ),
    "recover-sigint-while-recovering": Fault(
        "corp_deploy.recovery.training",
        "distillation_loss",
        2,
        "SIGINT",
        lambda w: ["recover", w / "art", "--recover-steps", 4, "--recover-batch-size", 2, "-o", w / "rec"],
        "rec",
    ),
    "compress-sighup-while-calibrating": Fault(
        "corp_deploy.engine", "embed_tokens", 2, "SIGHUP", lambda w: [*BASE, "-o", w / "art"], "art"
    ),
    "compress-sighup-while-the-output-is-swapped": Fault(
        "os", "rename", 1, "SIGHUP", lambda w: [*BASE, "--seed", 5, "-o", w / "art"], "art"
    ),
    "compress-sigterm-after-the-output-is-complete": Fault(
        "corp_deploy.latest", "record_latest", 1, "SIGTERM", lambda w: [*BASE, "--seed", 5, "-o", w / "art"], "art"
    ),
    "export-sigquit-while-exporting-onnx": Fault(
        "exporters.pipeline", "export_onnx", 2, "SIGQUIT", lambda w: ["export", w / "art", "--dense"], "art/export-fp32"
    ),
    "export-sigusr1-while-exporting-onnx": Fault(
        "exporters.pipeline", "export_onnx", 2, "SIGUSR1", lambda w: ["export", w / "art", "--dense"], "art/export-fp32"
    ),
    "export-sigpwr-while-exporting-onnx": Fault(
        "exporters.pipeline", "export_onnx", 2, "SIGPWR", lambda w: ["export", w / "art", "--dense"], "art/export-fp32"
    ),
    "recover-sigrtmin-plus-2-while-recovering": Fault(
        "corp_deploy.recovery.training",
        "distillation_loss",
        2,
        "SIGRTMIN+2",
        lambda w: ["recover", w / "art", "--recover-steps", 4, "--recover-batch-size", 2, "-o", w / "rec"],
        "rec",
    ),
    "sweep-sigquit-once-its-first-artifact-is-complete": Fault(
        "corp_deploy.outputs",
        "mark_complete",
        1,
        "SIGQUIT",
        lambda w: [
            "sweep",
            *BASE[1:],
            "--s",
            0.5,
            "--batch",
            1,
            "--min-time",
            0.01,
            "--backends",
            "torch",
            "-o",
            w / "sw",
        ],
        "sw",
    ),
    "export-sigterm-while-exporting-onnx": Fault(
        "exporters.pipeline", "export_onnx", 2, "SIGTERM", lambda w: ["export", w / "art", "--dense"], "art/export-fp32"
    ),
    "export-int8-sigterm-while-calibrating-ranges": Fault(
        "onnxruntime.quantization.calibrate",
        "save_tensors_data",
        1,
        "SIGTERM",
        lambda w: [
            "export",
            w / "art",
            "--precision",
            "int8",
            "--int8-keep-float",
            0,
            "--calib-samples",
            4,
            "-o",
            w / "art" / "export-int8",
        ],
        "art/export-int8",
    ),
    "bench-sigterm-while-timing": Fault(
        "benchmarks.harness", "interleaved", 1, "SIGTERM", lambda w: ["bench", w / "art", *BENCH, "-o", w / "b"], "b"
    ),
    "bench-sigterm-while-writing-the-reports": Fault(
        "benchmarks.report",
        "plot",
        1,
        "SIGTERM",
        lambda w: [
            "bench",
            w / "art",
            *BENCH,
            "--backends",
            "torch",
            "--json",
            w / "r.json",
            "--markdown",
            w / "r.md",
            "--plot",
            w / "r.png",
        ],
        "r.json",
    ),
    "sweep-sigint-after-the-first-run": Fault(
        "benchmarks.sweep",
        "export_artifact",
        2,
        "SIGINT",
        lambda w: [
            "sweep",
            *BASE[1:],
            "--s",
            "0.3,0.5",
            "--backends",
            "torch",
            "--batch",
            1,
            "--min-time",
            0.01,
            "--data-samples",
            2,
            "-o",
            w / "sweep",
        ],
        "sweep",
    ),
}


@pytest.fixture(scope="module")
def import_leftovers(tmp_path_factory) -> set[str]:
    """What importing the libraries leaves in the temporary directory by itself (ONNX Runtime's
    ``.ses``, torch's inductor cache folder): not the run's debris."""
    temp = tmp_path_factory.mktemp("imports")
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import corp_deploy.cli, exporters.pipeline, benchmarks.sweep, onnxruntime.quantization",
        ],
        check=True,
        env={**os.environ, "TMPDIR": str(temp)},
    )
    return {p.name for p in temp.iterdir()}


@pytest.mark.slow  # real subprocesses, interrupted
@pytest.mark.parametrize("name", sorted(FAULTS))
def test_an_interrupted_run_leaves_the_previous_output_intact_and_no_debris(name, tmp_path, built, import_leftovers):
    fault = FAULTS[name]
    work, temp = tmp_path / "w", tmp_path / "temp"
    temp.mkdir()
    shutil.copytree(built / "art", work / "art")
    with staged_output(work / "b", "bench") as previous:  # an earlier bench report, to be left intact
        (previous / "bench.json").write_text("{}")
    if name == "bench-sigterm-while-writing-the-reports":  # earlier reports there, all to be left as they were
        code, text, _ = invoke(FAULTS[name].args(work), tmp_path / "state")
        assert code == 0, text
    before = snapshot(work)
    env = {**os.environ, "TMPDIR": str(temp), "CORP_DEPLOY_STATE_DIR": str(tmp_path / "state")}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            FAULT_RUNNER,
            fault.module,
            fault.function,
            str(fault.call),
            fault.signal,
            *map(str, fault.args(work)),
        ],
        capture_output=True,
        text=True,
        cwd=work,
        env=env,
        timeout=600,
    )
    base, _, offset = fault.signal.partition("+")
    code = 128 + getattr(signal, base) + int(offset or 0)
    assert done.returncode == code, done.stderr
    assert f"stopped by {fault.signal}" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not debris(work) and {p.name for p in temp.iterdir()} <= import_leftovers
    after = snapshot(work)
    if name.endswith("-after-the-output-is-complete"):  # the message says so, not "nothing partial"
        assert f"{work / 'art'} was written before it and is complete" in done.stderr, done.stderr
    said = " ".join(done.stderr.split())
    said = said[said.index("stopped by") :]  # the last line: what was and was not written
    if name.startswith("sweep-"):  # the point's artifact went with the sweep's staging folder, unnamed
        assert f"{work / fault.output} was not written (nothing of it is left)" in said and "-s0" not in said, said
        assert not (work / fault.output).exists()
    elif name.endswith("-while-saving-into-new-folders"):
        assert f"{work / 'new' / 'deeper' / 'art'} was not written (nothing of it is left)" in said, said
    elif not name.endswith(("-while-the-output-is-swapped", "-after-the-output-is-complete")):
        assert f"{work / fault.output} was not written" in said, said  # named even before it was begun
    if name.endswith(("-while-the-output-is-swapped", "-after-the-output-is-complete")):
        # the swap is held together: the signal waits for it, so the new artifact is complete
        assert json.loads((work / "art" / "config.json").read_text())["settings"]["seed"] == 5
        verify_files(work / "art", "artifact")
        assert load_compressed(work / "art") is not None
    else:
        assert after == before, f"{fault.output} changed"


def _ends_the_process(signum: int) -> bool:
    """Whether ``signum`` at its default action ends a process, measured: a forked child sends it
    to itself (core dumps off); a child that stops or goes on is not ended by it."""
    pid = os.fork()
    if pid == 0:  # the child: nothing but the signal, then a plain exit
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
        os._exit(0)
    _, status = os.waitpid(pid, os.WUNTRACED)
    if os.WIFSTOPPED(status):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return False
    return os.WIFSIGNALED(status)


def test_every_signal_that_ends_a_process_by_default_is_an_interrupt():
    """The interrupts are every signal of this platform whose default action ends a process (each
    measured in a child), but SIGKILL, the faults a process raises on itself and SIGPIPE / SIGXFSZ,
    which Python ignores: SIGPWR, SIGIO and every real-time signal among them on Linux."""

    kept_out = {
        "SIGKILL",
        "SIGSEGV",
        "SIGBUS",
        "SIGFPE",
        "SIGILL",
        "SIGABRT",
        "SIGTRAP",
        "SIGSYS",
        "SIGPIPE",
        "SIGXFSZ",
    }
    others = [s for s in signal.valid_signals() if signal_name(s) not in kept_out]
    ending = {signal_name(s) for s in others if _ends_the_process(s)}
    assert {signal_name(s) for s in INTERRUPTS} == ending
    assert {"SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1"} <= ending
    if sys.platform.startswith("linux"):
        assert {"SIGPWR", "SIGIO", "SIGRTMIN+2", "SIGRTMAX"} <= ending


INTERRUPT_EVERY_WAY = """
import io, json, os, shutil, signal, sys, tempfile, time
from pathlib import Path
import click
from corp_deploy import launch
from corp_deploy.cli import cli
from corp_deploy.interrupts import INTERRUPTS
from corp_deploy.outputs import staged_output

@cli.command("stage")
@click.argument("dest")
@click.argument("signum", type=int)
def stage(dest, signum):
    # an output being staged and a temporary folder, as export has them, when the signal comes
    with staged_output(Path(dest), "bench") as tmp, tempfile.TemporaryDirectory(prefix="corp-deploy-export-"):
        (tmp / "bench.json").write_text("{}")
        os.kill(os.getpid(), signum)
        time.sleep(1)

dest, ignored = Path(sys.argv[1]), sys.argv[2:]
for signum in INTERRUPTS:
    for each in INTERRUPTS:  # a fresh process's dispositions (main ignores every one once it is done)
        signal.signal(each, signal.SIG_IGN if str(int(each)) in ignored else signal.SIG_DFL)
    sys.argv, sys.stderr = ["corp-deploy", "stage", str(dest), str(int(signum))], io.StringIO()
    try:
        launch.main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    said, sys.stderr = sys.stderr.getvalue(), sys.__stderr__
    print(json.dumps([int(signum), code, said, sorted(p.name for p in dest.parent.iterdir())]), flush=True)
    shutil.rmtree(dest, ignore_errors=True)  # the next run starts without this one's output
"""


@pytest.mark.slow  # a subprocess runs the command once per signal
def test_every_interrupt_leaves_no_staging_or_temporary_folder(tmp_path):
    """Each interrupt in turn (every signal of :data:`corp_deploy.interrupts.INTERRUPTS`, real-time
    ones included) stops a command that is staging an output and holds a temporary folder: 128 + N,
    one line naming the signal, no staging folder and nothing in the temporary directory. A signal
    the process was started ignoring (SIGHUP under ``nohup``) stays ignored: the command completes."""

    work, temp = tmp_path / "w", tmp_path / "temp"
    work.mkdir(), temp.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPT_EVERY_WAY, str(work / "out"), str(int(signal.SIGHUP))],
        capture_output=True,
        text=True,
        env={**os.environ, "TMPDIR": str(temp), "CORP_DEPLOY_STATE_DIR": str(tmp_path / "state")},
        timeout=600,
    )
    runs = {signum: (code, said, left) for signum, code, said, left in map(json.loads, done.stdout.splitlines())}
    assert sorted(runs) == sorted(map(int, INTERRUPTS)), done.stderr
    for signum, (code, said, left) in runs.items():
        if signum == signal.SIGHUP:  # ignored from the start: the output is written
            assert code == 0 and left == ["out"], (said, left)
            continue
        assert code == 128 + signum and said.count("\n") == 2, said  # a blank line, then the message
        assert f"stopped by {signal_name(signum)}; {work / 'out'} was not written" in said, said
        assert left == [], (signal_name(signum), left)
    assert list(temp.iterdir()) == []


LOADING_INTERRUPTED = """
import os, signal, sys
if sys.argv[1] == "ignored":  # as a script's background job starts it (POSIX: SIGINT ignored)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
loading = sys.argv[2]
class Hook:  # the named point: the import of ``loading``, which every command makes, sends the signal
    def find_spec(self, name, path, target=None):
        if name == loading:
            open("reached", "w").close()
            os.kill(os.getpid(), signal.SIGINT)
sys.meta_path.insert(0, Hook())
sys.argv = ["corp-deploy", *sys.argv[3:]]
from corp_deploy.launch import main
main()
"""


@pytest.mark.parametrize("started", ["at-default", "ignored"])
@pytest.mark.parametrize("loading", ["timm", "corp_deploy.errors"], ids=["timm", "the-entry-points-own-imports"])
def test_an_interrupt_while_the_libraries_load_exits_cleanly(tmp_path, started, loading):
    """SIGINT while the command imports torch and timm (the first seconds of every run), or while the
    entry point loads its own imports before its handlers are in place (Ctrl-C just after Enter: a
    25-line KeyboardInterrupt traceback, found by the hostile sweep), stops it: 130, one line, nothing
    written. Started with SIGINT ignored (a script's background job, as CI may start the suite: why
    this test once failed) the signal stays ignored and the command completes."""
    args = [*map(str, BASE), "-o", "out"]
    prefix = AS_A_FOREGROUND_JOB if started == "at-default" else ""
    done = subprocess.run(
        [sys.executable, "-c", prefix + LOADING_INTERRUPTED, started, loading, *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "CORP_DEPLOY_STATE_DIR": str(tmp_path / "state")},
    )
    assert (tmp_path / "reached").exists(), done.stderr  # the signal was sent while that module loaded
    assert "Traceback" not in done.stderr, done.stderr
    if started == "ignored":
        assert done.returncode == 0, done.stderr
        verify_files(tmp_path / "out", "artifact")
        return
    assert done.returncode == 130 and "stopped by SIGINT" in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reached"]
