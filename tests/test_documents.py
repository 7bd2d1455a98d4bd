"""The JSON documents' base (corp_deploy.documents): formats and versions, typed reading with one
message naming the file, exact round trips; report.json verified on read like config.json."""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from benchmarks.gate import read_baseline
from benchmarks.results import BENCH_FORMAT, BenchReport, BenchSettings, Int8Result, LatencyRow
from corp_deploy import CorpError, read_config, read_report
from corp_deploy.documents import Document, DocumentFormat, Machine, Record, optional_entry
from corp_deploy.files import json_text
from corp_deploy.outputs import RECORD_FILE, write_record

NOTE = DocumentFormat("corp-deploy-note", 2, "note", "write the note again", also_reads=(1,))


@dataclass
class Point(Record):
    x: float
    label: str | None = optional_entry()


@dataclass(kw_only=True)
class Note(Document):
    FORMAT = NOTE

    title: str
    count: int
    ratio: float
    points: list[Point]
    tags: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)
    where: Path | None = None


def note(**changes) -> dict:
    data = {
        "format": "corp-deploy-note",
        "format_version": 2,
        "title": "a",
        "count": 3,
        "ratio": 0.5,
        "points": [{"x": 1.0, "label": "first"}, {"x": 2}],
        "tags": ["p", "q"],
        "extra": {"free": [1, {"form": None}]},
        "where": "/tmp/x",
    }
    data.update(changes)
    return data


def test_a_document_round_trips_exactly_and_is_typed():
    data = note()
    parsed = Note.from_dict(data, "n.json")
    assert parsed.points == [Point(1.0, "first"), Point(2)] and parsed.tags == ("p", "q")
    assert parsed.where == Path("/tmp/x") and parsed.extra == {"free": [1, {"form": None}]}
    assert parsed.to_dict() == data and list(parsed.to_dict()) == list(data)  # same entries, same order
    assert "label" not in parsed.to_dict()["points"][1]  # an optional entry is left out while None
    assert Note.from_dict(note(format_version=1), "n.json").count == 3  # an older version still read
    assert math.isnan(Note.from_dict(note(ratio=None), "n.json").ratio)  # NaN is written as null


@pytest.mark.parametrize(
    "data, message",
    [
        ([], "n.json is not a corp-deploy note"),
        (note(format="corp-deploy-other"), "n.json is not a corp-deploy note"),
        (
            note(format_version=3),
            "n.json: note format version 3 is not supported by this corp-deploy (reads version 2, 1); write the "
            "note again",
        ),
        ({k: v for k, v in note().items() if k != "format_version"}, "note format version None is not supported"),
        (note(format_version="2"), "note format version '2' is not supported by this corp-deploy (reads version 2, 1)"),
        ({k: v for k, v in note().items() if k != "count"}, "n.json is malformed: it lacks count"),
        (note(count="3"), "n.json is malformed: count must be an integer, not a string"),
        (note(count=True), "n.json is malformed: count must be an integer, not true or false"),
        (note(ratio="x"), "n.json is malformed: ratio must be a number, not a string"),
        (note(points={}), "n.json is malformed: points must be a list, not an object"),
        (note(points=[{"x": 1}, {"label": "y"}]), "n.json is malformed: points row 1 lacks x"),
        (
            note(points=[{"x": 1, "label": 2}]),
            "n.json is malformed: points row 0.label must be a string, not an integer",
        ),
        (note(tags=["p", 1]), "n.json is malformed: tags[1] must be a string, not an integer"),
        (note(where=5), "n.json is malformed: where must be a path, not an integer"),
    ],
)
def test_a_bad_document_is_refused_naming_the_file_and_the_entry(data, message):
    with pytest.raises(CorpError) as caught:
        Note.from_dict(data, "n.json")
    assert message in str(caught.value)


def test_a_document_file_is_read_with_one_message_when_it_cannot_be(tmp_path):
    (tmp_path / "n.json").write_text(json.dumps(note()))
    assert Note.read(tmp_path / "n.json").title == "a"
    (tmp_path / "bad.json").write_text("{oops")
    for path, message in (
        (tmp_path / "gone.json", "not found"),
        (tmp_path, "is a directory"),
        (tmp_path / "bad.json", "cannot read note"),
    ):
        with pytest.raises(CorpError, match=message):
            Note.read(path)


def bench_report(**changes) -> dict:
    """A complete bench report as bench writes it (numbers made up)."""
    timing = {
        "runs": 5,
        "p50_s": 0.01,
        "p90_s": 0.012,
        "p99_s": 0.02,
        "mean_s": 0.011,
        "min_s": 0.009,
        "throughput_ips": 100.0,
    }
    ratio = {"median": 1.5, "p10": 1.4, "p90": 1.6, "min": 1.3, "max": 1.7, "rounds": 5}
    report = {
        **BENCH_FORMAT.header(),
        "created": "2025-01-01T00:00:00+0000",
        "machine": {"platform": "Linux", "cpu": "a CPU", "cpu_count": 2, "torch_threads": 2, "gpu": None},
        "versions": {"corp_deploy": "0.1.0", "tensorrt": None},
        "settings": BenchSettings(batches=(1,)).to_dict(),
        "models": {m: {"params": 10, "macs": 20, "onnx": f"{m}.onnx", "engine": None} for m in ("dense", "compressed")},
        "ideal_speedup": 2.0,
        "backends": {"ort-cpu": {"status": "ran"}, "trt": {"status": "skipped", "reason": "no GPU"}},
        "parity": {
            "compressed": {"ort-cpu": {"max_abs": 1e-7, "max_rel": 1e-5, "cosine": 1.0, "top1_agreement": None}}
        },
        "attention": {"torch-cpu": {"dense": "flash x2", "compressed": "math x2"}},
        "latency": [
            {
                "backend": "ort-cpu",
                "batch": 1,
                "timing": "cpu",
                "dense": timing,
                "compressed": timing,
                "speedup": ratio,
                "ideal_speedup": 2.0,
                "efficiency": 0.75,
            }
        ],
        "fidelity": {
            "images": 4,
            "feature_cosine": 0.99,
            "top1_agreement": 0.75,
            "kl_mean": 0.01,
            "accuracy": {"dense": {"top1": 0.5, "top5": 1.0}, "compressed": {"top1": 0.5, "top5": 0.75}},
            "data": {"source": "builtin"},
            "held_out": True,
        },
        "int8": {
            "latency": [
                {
                    "batch": 1,
                    **{graph: timing for graph in ("dense-fp32", "dense-int8", "compressed-fp32", "compressed-int8")},
                    "speedup_over_dense_fp32": {"compressed-int8": ratio},
                    "int8_over_fp32": {"dense": ratio, "compressed": ratio},
                }
            ],
            "fidelity": {"compressed-int8": {"cosine_mean": 0.99, "cosine_min": 0.98, "top1_agreement": None}},
            "bytes": {"compressed-int8": 1000},
            "kept_float": {"compressed-int8": 2},
        },
        "gate": {"baseline": None, "limits": {"max_regression": 0.05}, "passed": True, "regressions": []},
    }
    report.update(changes)
    return report


def test_the_bench_report_round_trips_to_the_same_json_and_reads_by_attribute():
    data = bench_report()
    report = BenchReport.from_dict(data, "bench.json")
    assert json_text(report.to_dict()) == json_text(data)
    row = report.latency[0]
    assert isinstance(row, LatencyRow) and row.compressed.p50_s == 0.01 and row.speedup.median == 1.5
    assert report.fidelity.accuracy["compressed"].top5 == 0.75 and report.machine == Machine(
        "Linux", "a CPU", 2, 2, None
    )
    assert report.settings == BenchSettings(batches=(1,)) and report.skipped_backends() == {"trt": "no GPU"}
    assert report.int8.latency[0].timings["compressed-int8"].p50_s == 0.01 and report.gate.passed
    skipped = BenchReport.from_dict(bench_report(int8={"skipped": "no export-int8/"}, gate=None))
    assert skipped.int8 == Int8Result(skipped="no export-int8/")
    assert skipped.to_dict()["int8"] == {"skipped": "no export-int8/"} and "gate" not in skipped.to_dict()
    del data["int8"], data["gate"]  # what run_bench alone returns: neither entry
    assert list(BenchReport.from_dict(data).to_dict()) == list(data)


def test_a_baseline_needs_only_what_the_gate_compares(tmp_path):
    row = {"backend": "ort-cpu", "batch": 1, "compressed": {"p50_s": 0.01}, "speedup": {"median": 1.2}}
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps({"format": "corp-deploy-bench", "latency": [row], "fidelity": {}}))
    baseline = read_baseline(path)
    assert baseline.latency[0].dense is None and baseline.models == {} and baseline.fidelity.top1_agreement is None
    cases = [
        (bench_report(latency=[{**row, "batch": "1"}]), "latency row 0.batch must be an integer, not a string"),
        (bench_report(fidelity={"feature_cosine": "high"}), "fidelity.feature_cosine must be a number, not a string"),
        (bench_report(machine={"cpu": "x"}), "machine lacks platform"),
        (bench_report(format_version=3), "bench report format version 3 is not supported"),
        (bench_report(int8={"latency": []}), "int8 needs latency rows with a batch and the compressed-int8 speedup"),
    ]
    for data, message in cases:
        path.write_text(json.dumps(data))
        with pytest.raises(CorpError) as caught:
            read_baseline(path)
        assert f"baseline {path}" in str(caught.value) and message in str(caught.value), caught.value


def test_report_json_names_its_format_and_is_verified_on_read(tiny_artifact_copy):
    art = tiny_artifact_copy
    report = read_report(art)
    assert report["format"] == "corp-deploy-compress-report" and report["format_version"] == 1
    assert "layers" in report and read_config(art)  # the compress report itself follows the header

    def edit(change, record: bool) -> None:
        data = json.loads((art / "report.json").read_text())
        change(data)
        (art / "report.json").write_text(json.dumps(data))
        if record:  # edited along with the record, as someone who edits both would
            (art / RECORD_FILE).unlink()
            write_record(art, "artifact")

    edit(lambda r: r.update(params={}), record=False)
    with pytest.raises(CorpError, match="report.json does not match the SHA-256"):
        read_report(art)
    edit(lambda r: r.update(format_version=7), record=True)
    with pytest.raises(CorpError, match="report.json: artifact format version 7 is not supported"):
        read_report(art)
    edit(lambda r: r.update(format="corp-deploy-bench"), record=True)
    with pytest.raises(CorpError, match="is not the report.json of a corp-deploy artifact"):
        read_report(art)
    # an artifact written before report.json named its format: still read, as it is
    edit(lambda r: [r.pop("format"), r.pop("format_version")], record=True)
    assert "format" not in read_report(art) and "layers" in read_report(art)
