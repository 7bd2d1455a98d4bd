"""It never deletes or overwrites what it did not write, and never leaves half an output: outputs
replaced only when they are the tool's own and unchanged, written through links, kept when the
removal of the old one cannot finish, safe under concurrent writers; export's follow-up files
(build_engine.sh) and printed commands safe to run."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

import corp_deploy.outputs as outputs
from corp_deploy import load_compressed
from corp_deploy.files import write_json
from corp_deploy.outputs import RECORD_FILE, staged_output, verify_files
from exporters import tensorrt as trt_backend
from tests.reliability.common import BASE, BENCH, debris, flip_byte, invoke


def test_the_tools_own_output_is_replaced_with_the_exports_inside_it(work):
    assert (work / "art" / "export-fp32").is_dir()
    code, text, _ = invoke([*BASE, "--seed", 3, "-o", work / "art"], work.parent / "state")
    assert code == 0, text
    assert sorted(p.name for p in (work / "art").iterdir()) == [
        "config.json",
        RECORD_FILE,
        "model.safetensors",
        "report.json",
    ]
    assert json.loads((work / "art" / "config.json").read_text())["settings"]["seed"] == 3
    assert not debris(work)


def test_a_symlinked_output_is_written_through_the_link(work):
    (work / "link").symlink_to(work / "art")
    code, text, _ = invoke([*BASE, "--seed", 3, "-o", work / "link"], work.parent / "state")
    assert code == 0, text
    assert (work / "link").is_symlink() and os.readlink(work / "link") == str(work / "art")
    assert json.loads((work / "link" / "config.json").read_text())["settings"]["seed"] == 3
    assert load_compressed(work / "link") is not None and not debris(work)


def test_bench_replaces_its_own_report_folder_and_json(work):
    for _ in range(2):
        code, text, _ = invoke(
            ["bench", work / "art", *BENCH, "--backends", "torch", "-o", work / "b", "--json", work / "r.json"],
            work.parent / "state",
        )
        assert code == 0, text
    assert sorted(p.name for p in (work / "b").iterdir()) == ["bench.md", "bench.png", RECORD_FILE]
    verify_files(work / "b", "bench")
    assert json.loads((work / "r.json").read_text())["format"] == "corp-deploy-bench" and not debris(work)


def test_an_old_output_that_cannot_be_removed_completely_is_left_with_a_warning(work, monkeypatch):
    """The new output is in place; what the file system refuses to delete stays, named, and the run
    succeeds (before: an error after the swap, exit 1)."""
    original = Path.unlink

    def refuse(self, *args, **kwargs):
        if self.name == "dense.onnx" and ".art.old-" in str(self):
            raise PermissionError(1, "Operation not permitted")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", refuse)
    with pytest.warns(UserWarning, match="the old one could not be removed completely") as warned:
        code, text, _ = invoke([*BASE, "--seed", 3, "-o", work / "art"], work.parent / "state")
    assert code == 0, text
    assert len(warned) == 1 and "export-fp32/dense.onnx: Operation not permitted" in str(warned[0].message)
    assert json.loads((work / "art" / "config.json").read_text())["settings"]["seed"] == 3
    left = [p.name for p in work.iterdir() if p.name.startswith(".art.old-")]
    assert len(left) == 1 and [p.name for p in (work / left[0]).rglob("*")] == ["export-fp32", "dense.onnx"]


def test_a_file_of_the_old_output_changed_after_the_check_is_kept(work, monkeypatch):
    """Removing the old output deletes a file only if it still has its recorded content: one another
    program rewrote between the check and the removal stays, named in the warning."""

    original = outputs._remove_output

    def rewrite_then_remove(folder):
        (folder / "config.json").write_text("edited by someone else")
        return original(folder)

    monkeypatch.setattr(outputs, "_remove_output", rewrite_then_remove)
    with pytest.warns(UserWarning, match="config.json: changed since it was checked"):
        code, text, _ = invoke([*BASE, "--seed", 5, "-o", work / "art"], work.parent / "state")
    assert code == 0, text
    (left,) = [p for p in work.iterdir() if p.name.startswith(".art.old-")]
    assert (left / "config.json").read_text() == "edited by someone else"
    assert json.loads((work / "art" / "config.json").read_text())["settings"]["seed"] == 5


def test_the_old_record_rewritten_after_it_was_read_is_kept(work, monkeypatch):
    """The old output's record is deleted only while it is still the one read at the start of the
    removal: one another program rewrote meanwhile stays, named in the warning."""

    original = outputs.read_record

    def read_then_rewrite(folder):
        record = original(folder)
        path = Path(folder) / outputs.RECORD_FILE
        if ".art.old-" in str(folder) and record is not None and "rewritten" not in record:
            path.write_text(json.dumps({**record, "rewritten": True}))
        return record

    monkeypatch.setattr(outputs, "read_record", read_then_rewrite)
    with pytest.warns(UserWarning, match="corp-deploy-record.json: changed since it was checked"):
        code, text, _ = invoke([*BASE, "--seed", 5, "-o", work / "art"], work.parent / "state")
    assert code == 0, text
    (left,) = [p for p in work.iterdir() if p.name.startswith(".art.old-")]
    assert json.loads((left / outputs.RECORD_FILE).read_text())["rewritten"] is True


def test_a_failure_after_the_swap_keeps_the_new_output(tmp_path):
    """Once the staged output is in place its name is the destination's: an error raised afterwards
    (here the leftover warning turned into an error) removes nothing."""
    with staged_output(tmp_path / "out", "sweep") as staging:
        (staging / "a.txt").write_text("old")
    original = Path.unlink

    def refuse(self, *args, **kwargs):
        if self.name == "a.txt" and ".out.old-" in str(self):
            raise PermissionError(1, "Operation not permitted")
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        patch.setattr(Path, "unlink", refuse)
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="could not be removed completely"):
            with staged_output(tmp_path / "out", "sweep") as staging:
                (staging / "a.txt").write_text("new")
    assert (tmp_path / "out" / "a.txt").read_text() == "new"
    verify_files(tmp_path / "out", "sweep")


def test_the_build_script_quotes_a_timing_cache_path_with_a_newline(work):
    cache = work / "cache\ntouch INJECTED\n#"
    code, text, _ = invoke(
        ["export", work / "art", "--trt", "--timing-cache", cache, "-o", work / "trt"], work.parent / "state"
    )
    assert code in (0, 3), text
    done = subprocess.run(
        ["bash", str(work / "trt" / "build_engine.sh")],
        capture_output=True,
        text=True,
        cwd=work,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 127 and "trtexec not found" in done.stderr  # it ran up to the missing trtexec
    assert not list(work.rglob("INJECTED")) and not list((work / "trt").glob("INJECTED"))


def test_the_build_script_refuses_a_changed_graph(work):
    code, text, _ = invoke(["export", work / "art", "--trt", "-o", work / "trt"], work.parent / "state")
    assert code in (0, 3), text
    flip_byte(work / "trt" / "model.onnx")
    done = subprocess.run(
        ["bash", str(work / "trt" / "build_engine.sh")], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}
    )
    assert done.returncode == 1 and "model.onnx does not match the SHA-256" in done.stderr


def _pasted(line: str, cwd: Path) -> list[str]:
    """The words bash makes of ``line`` (a printed command) when it is pasted: each word printed
    by ``printf`` instead of run, so that nothing in it can run."""
    done = subprocess.run(
        ["bash", "-c", f"words() {{ printf '%s\\0' \"$@\"; }}; words {line}"],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\0")[:-1]


@pytest.mark.skipif(
    trt_backend.unavailable_reason() is None,
    reason="TensorRT and a GPU are present: no follow-up commands are printed",
)
def test_the_printed_follow_up_commands_are_safe_to_paste(work):
    """``export --trt`` without TensorRT prints the commands to run on the target machine: paths
    with a space, quotes and ``$(...)`` stay one word each and run nothing when pasted."""
    hostile = work / "it's a $(touch INJECTED) `touch INJECTED2`"
    shutil.copytree(work / "art", hostile / "art")
    code, text, _ = invoke(["export", hostile / "art", "--trt", "-o", hostile / "out"], work.parent / "state")
    assert code == 3, text
    export_line = next(line.strip() for line in text.splitlines() if "&& corp-deploy export" in line)
    script_line = next(line.strip() for line in text.splitlines() if line.strip().startswith("bash "))
    command = export_line.split(" && ", 1)[1]
    assert _pasted(command, work) == [
        "corp-deploy", "export", str(hostile / "art"), "--trt", "-o", str(hostile / "out")
    ]  # fmt: skip
    assert _pasted(script_line, work) == ["bash", str(hostile / "out" / "build_engine.sh")]
    assert not list(work.rglob("INJECTED*"))


def _write_state(args) -> int:
    path, writer = args
    for i in range(25):
        write_json(path, {"writer": writer, "i": i})
    return writer


def _stage_output(args) -> int:
    dest, writer = args
    for i in range(5):
        with staged_output(dest, "bench") as tmp:
            (tmp / "bench.json").write_text(json.dumps({"writer": writer, "i": i}))
    return writer


def test_concurrent_state_writers_all_succeed_and_leave_no_temporary_files(tmp_path):
    context = multiprocessing.get_context("fork")
    with context.Pool(8) as pool:
        done = pool.map(_write_state, [(tmp_path / "latest.json", w) for w in range(32)])
    assert sorted(done) == list(range(32))  # no writer failed (800 writes)
    assert json.loads((tmp_path / "latest.json").read_text())["i"] == 24
    assert [p.name for p in tmp_path.iterdir()] == ["latest.json"]


def test_concurrent_writers_of_one_output_all_succeed_and_leave_one_whole_output_and_no_siblings(tmp_path):
    context = multiprocessing.get_context("fork")
    with context.Pool(4) as pool:
        assert sorted(pool.map(_stage_output, [(tmp_path / "out", w) for w in range(4)])) == [0, 1, 2, 3]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    verify_files(tmp_path / "out", "bench")
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["i"] == 4


def test_an_edited_bench_markdown_report_is_not_replaced(tmp_path, built):
    """bench's Markdown report ends with the digest of what it wrote: a later run replaces it while
    it is unedited, and refuses once someone added to it (their words are kept)."""
    report = tmp_path / "r.md"
    args = ["bench", built / "art", *BENCH, "--backends", "torch", "--markdown", report]
    for _ in range(2):
        code, text, _ = invoke(args, tmp_path / "state")
        assert code == 0, text
    report.write_text(report.read_text() + "Sign-off: approved, keep this\n")
    code, text, _ = invoke(args, tmp_path / "state")
    assert code == 1 and "refusing to overwrite" in text and "edited" in text, text
    assert report.read_text().endswith("Sign-off: approved, keep this\n")


def test_the_follow_up_command_of_an_unverified_export_is_the_whole_command(tmp_path, built):
    """A bf16 export that cannot be checked here prints the command to run on a GPU machine with the
    artifact and every option given (never a command that would export another artifact there)."""
    code, text, _ = invoke(["export", built / "art", "--precision", "bf16", "--dense", "-o", tmp_path / "x"], tmp_path)
    assert code == 3, text
    assert f"corp-deploy export {built / 'art'} --precision bf16 --dense -o {tmp_path / 'x'}" in text, text


def test_an_edited_bench_json_report_is_not_replaced(tmp_path, built):
    """bench's JSON report ends with the digest of its other entries: a later run replaces it while
    it is unedited, and refuses once someone added an entry or removed the digest (theirs is kept);
    as a baseline it reads as before."""
    report = tmp_path / "r.json"
    args = ["bench", built / "art", *BENCH, "--backends", "torch", "--json", report]
    for _ in range(2):
        code, text, _ = invoke(args, tmp_path / "state")
        assert code == 0, text
    baseline = ["--baseline", report, "--gate", "fidelity"]  # timings move with the machine's load
    code, text, _ = invoke([*args[:-1], tmp_path / "next.json", *baseline], tmp_path / "state")
    assert code == 0, text
    data = json.loads(report.read_text())
    report.write_text(json.dumps({**data, "note": "approved, keep this"}, indent=2))
    code, text, _ = invoke(args, tmp_path / "state")
    assert code == 1 and "refusing to overwrite" in text and "edited" in text, text
    assert json.loads(report.read_text())["note"] == "approved, keep this"
    for own in (  # no digest: not known to be bench's, whatever its format entry says
        {"format": "corp-deploy-bench", "mine": True},
        {key: value for key, value in data.items() if key != "sha256_of_the_report_above"},
    ):
        report.write_text(json.dumps(own))
        code, text, _ = invoke(args, tmp_path / "state")
        assert code == 1 and "refusing to overwrite" in text, text
        assert json.loads(report.read_text()) == own
