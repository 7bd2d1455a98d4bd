"""Export a (compressed or dense) timm ViT to a checked ONNX file with a dynamic batch axis.

Exporter and opset defaults come from measurements on dense and pruned DeiT
(``lab/studies/export_choice.py``, results in ``lab/RESULTS.md``).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from corp_deploy.errors import CorpError, SettingError, check_choice, described, first_line
from corp_deploy.resources import MAX_BATCH

from .fusable_forms import rewrite_gelu
from .reduced_precision import for_export

INPUT_NAME, OUTPUT_NAME = "images", "outputs"
BATCH_AXIS = "batch"
EXPORTERS = ("dynamo", "torchscript")
DEFAULT_EXPORTER = "dynamo"
DEFAULT_OPSET = 18
MIN_OPSET = 17  # LayerNormalization is an ONNX op from opset 17 on
#: Protobuf cannot serialise a message of 2 GiB or more; larger models keep their weights
#: in one external file ``<name>.data`` beside the graph.
PROTOBUF_LIMIT = 2**31


def export_onnx(
    model: nn.Module,
    path: str | Path,
    input_size: tuple[int, int, int],
    *,
    opset: int = DEFAULT_OPSET,
    exporter: str = DEFAULT_EXPORTER,
    precision: str = "fp32",
    trace_batch: int = 2,
    single_file_limit: int = PROTOBUF_LIMIT,
) -> dict:
    """Write ``model`` as ONNX to ``path`` (atomically), then check it and infer its shapes. Its
    GELUs are written in the form ONNX Runtime fuses (:mod:`exporters.fusable_forms`).

    Args:
        model: a timm ViT (dense or compressed), float32; it is not modified.
        input_size: ``(C, H, W)`` of one image; only the batch axis is dynamic.
        precision: one whose graph is the traced model (:data:`exporters.precision.TRACED`:
            ``fp32``, ``fp16``, ``bf16``; see :mod:`exporters.reduced_precision`); the graph's
            input and output are float32 in every case.
        trace_batch: batch size of the example input used for tracing.
        single_file_limit: when the model would serialise to this many bytes or more, its weights
            go to ``<path>.data`` (default: protobuf's 2 GiB limit).
    Returns:
        ``{"files", "opset", "exporter", "precision", "inputs", "outputs", "dynamic_axes"}``;
        ``files`` lists the written file names (the graph first), shapes use ``"batch"`` for
        the dynamic axis.
    """
    import onnx

    check_settings(opset, exporter)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    traced = for_export(model, precision)
    example = torch.zeros(trace_batch, *input_size)
    with tempfile.TemporaryDirectory(prefix=f".{path.name}.", dir=path.parent) as work:
        raw = Path(work) / "raw" / "model.onnx"
        raw.parent.mkdir()
        with _exporter_failure(opset, exporter):
            _run_exporter(traced, example, raw, opset, exporter)
        proto = onnx.load(str(raw))  # also reads any external weight files
        rewrite_gelu(proto.graph)
        staged = Path(work) / path.name
        data_name = None
        if proto.ByteSize() >= single_file_limit:
            data_name = path.name + ".data"
            onnx.save_model(
                proto,
                str(staged),
                save_as_external_data=True,
                all_tensors_to_one_file=True,
                location=data_name,
                size_threshold=1024,
            )
        else:
            onnx.save_model(proto, str(staged))
        del proto
        with _exporter_failure(opset, exporter):
            onnx.checker.check_model(str(staged), full_check=True)
            onnx.shape_inference.infer_shapes_path(
                str(staged), str(staged), check_type=True, strict_mode=True, data_prop=True
            )
        if data_name is not None:
            os.replace(Path(work) / data_name, path.parent / data_name)
        os.replace(staged, path)
    graph = onnx.load(str(path), load_external_data=False).graph
    return {
        "files": [path.name] + ([data_name] if data_name else []),
        "opset": opset,
        "exporter": exporter,
        "precision": precision,
        "inputs": [_describe(v) for v in graph.input],
        "outputs": [_describe(v) for v in graph.output],
        "dynamic_axes": {INPUT_NAME: {"0": BATCH_AXIS}, OUTPUT_NAME: {"0": BATCH_AXIS}},
    }


def check_settings(opset: int, exporter: str) -> None:
    """SettingError unless ``exporter`` is known and ``opset`` is one it can write and ONNX Runtime
    (the parity gate's runtime) can load."""
    check_choice("exporter", exporter, EXPORTERS)
    highest = max_opset(exporter)
    valid = isinstance(opset, int) and not isinstance(opset, bool) and MIN_OPSET <= opset <= highest
    if not (valid and (opset <= DEFAULT_OPSET or writes_attention(exporter, opset))):
        # the highest the exporter writes attention in, named only when refusing (each try takes seconds)
        highest = next((o for o in range(highest, DEFAULT_OPSET, -1) if writes_attention(exporter, o)), DEFAULT_OPSET)
        raise SettingError(
            f"{{setting}} must be between {MIN_OPSET} and {highest} with the {exporter} exporter (the "
            f"highest that it and this ONNX Runtime support); got {described(opset)}",
            "opset",
        )


@functools.cache
def max_opset(exporter: str) -> int:
    """The highest ONNX opset ``exporter`` writes here that this ONNX Runtime also loads."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    if exporter == "torchscript":
        from torch.onnx import _constants

        highest = getattr(_constants, "ONNX_MAX_OPSET", _constants.ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET)
    else:
        highest = onnx.defs.onnx_opset_version()
    options = ort.SessionOptions()
    options.log_severity_level = 4
    value = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    for opset in range(highest, MIN_OPSET, -1):
        imports = [helper.make_opsetid("", opset)]
        probe = helper.make_model(
            helper.make_graph(
                [helper.make_node("Identity", ["x"], ["y"])],
                "probe",
                [value],
                [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
            ),
            opset_imports=imports,
            ir_version=helper.find_min_ir_version_for(imports),
        )
        try:
            ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
            return opset
        except Exception:  # noqa: BLE001 - ORT refuses an opset it does not know with its own error types
            continue
    return MIN_OPSET


@functools.cache
def writes_attention(exporter: str, opset: int) -> bool:
    """Whether ``exporter`` writes a ViT attention block at ``opset`` as a graph this ONNX Runtime
    loads and runs: an opset ONNX Runtime knows is not always one the exporter writes attention
    in (torch 2.14's dynamo exporter at opset 26 writes an ``Attention`` op it cannot load). Checked
    on a tiny block (a few seconds) for the opsets above :data:`DEFAULT_OPSET` a user asks for."""
    import onnxruntime as ort
    from timm.layers import Attention

    with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
        torch.manual_seed(0)
        block, example = Attention(16, num_heads=2).eval(), torch.randn(2, 5, 16)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "attention.onnx"
        try:
            _run_exporter(block, example, path, opset, exporter)
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            session.run(None, {INPUT_NAME: example.numpy()})
        except Exception:  # noqa: BLE001 - the exporters and ONNX Runtime fail with many types
            return False
    return True


@contextlib.contextmanager
def _exporter_failure(opset: int, exporter: str):
    """An exporter or ONNX check failing on this model at ``opset`` as one CorpError naming both (a
    full disk or memory stays what it is): an opset the libraries list is not one that every
    exporter writes for every op (torch's exporter fails on attention at opset 26, say)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - torch's and ONNX's exporters raise many types
        cause = exc
        while cause is not None:  # an OS error wrapped by the exporter is reported as one
            if isinstance(cause, (OSError, MemoryError)):
                raise
            cause = cause.__cause__ or cause.__context__
        raise CorpError(
            f"the {exporter} exporter could not write a valid opset-{opset} graph of this model "
            f"({first_line(exc)}); choose another --opset (default {DEFAULT_OPSET})"
        ) from None


def _run_exporter(model: nn.Module, example: torch.Tensor, path: Path, opset: int, exporter: str) -> None:
    """Trace ``model`` on ``example`` into ``path`` (weights may land in files beside it).

    The exporters' own progress lines, deprecation/tracer warnings and log warnings (e.g. that an
    opset below 18 is converted from 18) are swallowed: the result is checked afterwards
    (``onnx.checker``, shape inference, and the parity gate at batch sizes other than the traced one).
    """
    common = dict(input_names=[INPUT_NAME], output_names=[OUTPUT_NAME], opset_version=opset)
    with (
        torch.no_grad(),
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        _quiet_loggers("torch.onnx", "onnxscript"),
    ):
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            batch = torch.export.Dim(BATCH_AXIS, min=1, max=MAX_BATCH)
            torch.onnx.export(
                model,
                (example,),
                str(path),
                dynamo=True,
                external_data=True,
                dynamic_shapes=({0: batch},),
                verbose=False,
                **common,
            )
        else:
            torch.onnx.export(
                model,
                (example,),
                str(path),
                dynamo=False,
                dynamic_axes={INPUT_NAME: {0: BATCH_AXIS}, OUTPUT_NAME: {0: BATCH_AXIS}},
                **common,
            )


@contextlib.contextmanager
def _quiet_loggers(*names: str):
    """Only errors from the loggers ``names`` (and their children) inside the block."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _describe(value) -> dict:
    import onnx

    tensor_type = value.type.tensor_type
    dims = [d.dim_param or d.dim_value for d in tensor_type.shape.dim]
    return {
        "name": value.name,
        "shape": dims,
        "dtype": onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).name,
    }
