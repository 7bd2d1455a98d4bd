"""The export precisions' records (exporters/precision.py), the int8 options (exporters/int8_options.py)
and how ExportOptions and the export command read them."""

import dataclasses

import pytest
import torch

from corp_deploy import CorpError
from exporters import PRECISIONS, ExportOptions, Int8Options, Precision, Tolerance
from exporters import tensorrt as trt_backend
from exporters.precision import TRACED, precision_named, precision_tolerance


def test_every_precision_has_a_default_tolerance_and_a_traced_type():
    assert list(PRECISIONS) == ["fp32", "fp16", "bf16", "int8"]
    for name, precision in PRECISIONS.items():
        assert isinstance(precision, Precision) and precision.name == name
        assert isinstance(precision.tolerance, Tolerance)
        assert any(value is not None for value in dataclasses.asdict(precision.tolerance).values()), name
        assert precision.dtype in (torch.float32, torch.float16, torch.bfloat16)
        assert precision.onnxruntime_device == "cpu" or precision.not_on_cpu, name
    assert TRACED == ("fp32", "fp16", "bf16")
    assert [name for name, p in PRECISIONS.items() if p.calibrates] == ["int8"]
    assert PRECISIONS["int8"].options_class is Int8Options
    assert all(p.options_class is None for name, p in PRECISIONS.items() if name != "int8")


def test_an_unknown_precision_is_refused_naming_every_one():
    with pytest.raises(CorpError, match="precision must be one of fp32, fp16, bf16, int8; got 'int4'"):
        precision_named("int4")
    with pytest.raises(CorpError, match="precision must be one of fp32, fp16, bf16, int8; got 'int4'"):
        ExportOptions(precision="int4")
    with pytest.raises(CorpError, match="precision must be one of fp32, fp16, bf16; got 'int8'"):
        precision_named("int8", among=TRACED)


def test_tolerance_overrides_and_the_old_spelling_give_the_records_limits():
    fp16 = PRECISIONS["fp16"].tolerance
    assert fp16.with_limits(atol=1e-2, min_cosine=None) == Tolerance(atol=1e-2, min_cosine=0.999, min_top1=0.85)
    for name, precision in PRECISIONS.items():
        assert precision_tolerance(name) == precision.tolerance
        assert precision_tolerance(name, min_cosine=0.5) == precision.tolerance.with_limits(min_cosine=0.5)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_int8_options_with_another_precision_are_refused(precision):
    """The library names its fields (the command names the options typed, before ExportOptions)."""
    with pytest.raises(
        CorpError, match=rf"the int8 options \(int8: .*\) apply only with precision int8, not {precision}"
    ):
        ExportOptions(precision=precision, int8=Int8Options())
    with pytest.raises(
        CorpError, match="workspace_gb and timing_cache configure the TensorRT build; they apply only with trt"
    ):
        ExportOptions(precision=precision, workspace_gb=2.0)


def test_int8_gets_its_default_options(tmp_path):
    assert ExportOptions(precision="int8").int8 == Int8Options()
    assert ExportOptions().int8 is None
    options = ExportOptions(precision="int8", int8=Int8Options(smoothing=None, keep_float=3, calib=tmp_path))
    assert dataclasses.replace(options, dense=True).int8 == options.int8


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(calibration="mse"), "int8_calibration must be one of minmax, entropy, percentile; got 'mse'"),
        (dict(activations="int4"), "int8_activations must be one of int8, uint8; got 'int4'"),
        (dict(smoothing=1.5), "int8_smoothing must be from 0 to 1 or None, got 1.5"),
        (
            dict(keep_float=-1),
            r"int8_keep_float \(the Linear layers kept in float\) must be 'auto' or a number >= 0, got -1",
        ),
        (dict(calib_samples=0), "calib_samples must be >= 1, got 0"),
        (dict(smoothing="0.5"), "int8_smoothing must be a number, got str '0.5'"),
        (dict(calib="/nonexistent/dir"), "calib /nonexistent/dir: not found"),  # the field; export says --calib
    ],
)
def test_int8_options_check_their_values(options, message):
    with pytest.raises(CorpError, match=message):
        Int8Options(**options)


def test_int8_options_name_their_flags():
    assert Int8Options.flags() == {
        "calibration": "--int8-calibration",
        "keep_float": "--int8-keep-float",
        "smoothing": "--int8-smoothing",
        "activations": "--int8-activations",
        "calib": "--calib",
        "calib_samples": "--calib-samples",
    }
    assert Int8Options.keywords()["int8_keep_float"] == "keep_float"
    with pytest.raises(CorpError, match="TensorRT needs signed int8 activations"):
        ExportOptions(precision="int8", trt=True, int8=Int8Options(activations="uint8"))


def test_the_build_script_carries_the_records_tensorrt_note():
    def script(precision: str) -> str:
        return trt_backend.build_script(
            ["model.onnx"],
            {"model.onnx": "0" * 64},
            batch=trt_backend.BatchProfile(),
            image_shape=(3, 32, 32),
            precision=PRECISIONS[precision],
        )

    assert "#   precision fp16: taken from the ONNX graph" in script("fp16") and "Q/DQ" not in script("fp16")
    int8 = script("int8")
    assert "#   precision int8: taken from the ONNX graph" in int8
    assert all(f"#   {line}\n" in int8 for line in PRECISIONS["int8"].tensorrt_note)


def test_export_help_shows_each_records_default_limits(run_cli, tmp_path):
    result, text = run_cli(["export", "--help"], tmp_path / "state")
    assert result.exit_code == 0, text
    said = " ".join(text.split())  # click wraps the help text
    assert "[default: 0.0001 fp32, not checked for fp16/bf16/int8]" in said
    cosines = ", ".join(f"{p.tolerance.min_cosine:g} {name}" for name, p in PRECISIONS.items())
    assert f"[default: {cosines}]" in said and "0.99999 fp32, 0.999 fp16, 0.99 bf16, 0.98 int8" in cosines
    assert "--precision [fp32|fp16|bf16|int8]" in said


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_the_export_command_refuses_an_int8_option_with_another_precision(precision, run_cli, tiny_artifact, tmp_path):
    result, text = run_cli(
        ["export", tiny_artifact, "--precision", precision, "--int8-smoothing", 0.5, "--calib-samples", 4],
        tmp_path / "state",
    )
    assert result.exit_code != 0 and "--int8-smoothing, --calib-samples apply only with --precision int8" in text
