"""The bench report: how ``corp-deploy bench`` measured (:class:`BenchSettings`) and what
(:class:`BenchReport`), as typed records that serialise (``to_dict``) to exactly the entries of
its JSON report and are read back checked (``from_dict``, :mod:`corp_deploy.documents`).

:func:`benchmarks.harness.run_bench` builds a report, :mod:`benchmarks.int8` its int8 section,
:mod:`benchmarks.pipeline` adds the gate's verdict; :mod:`benchmarks.report` renders it,
:mod:`benchmarks.gate` compares it with a baseline, and a sweep keeps one per run.

A report read back (a baseline) must hold what the regression gate compares: the latency rows'
backend, batch size, compressed median time and median speedup, and a fidelity object. Every other
entry bench always writes, but a baseline written by hand may leave it out (a missing number or
record is None, a missing table empty).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from corp_deploy.documents import (
    Document,
    DocumentFormat,
    Machine,
    Record,
    fields_from_json,
    from_json,
    optional_entry,
)
from corp_deploy.errors import CorpError, SettingError, check_choices, check_setting_types, described
from corp_deploy.resources import MAX_BATCH
from exporters.parity import Comparison
from exporters.runners import TORCH_PRECISIONS

from .backends import DEFAULT_FAMILIES, DEVICE_RESIDENT, FAMILIES, HOST_TO_HOST, TIMINGS, row_timings

#: 2: how each latency row was timed (``timing``, and on a GPU the other figure beside it), the timing
#: and CUDA graphs settings, compile times. Version 1 (every row timed host to host) is still read, and
#: a report without ``format_version`` (a baseline written by hand).
BENCH_FORMAT = DocumentFormat("corp-deploy-bench", 2, "bench report", "run bench again", also_reads=(1, None))
#: The two models every report compares, in the order they are timed and listed.
MODELS = ("dense", "compressed")


@dataclass(frozen=True)
class BenchSettings(Record):
    """How to measure. ``min_time``: seconds each model is timed per backend and batch size
    (at least ``min_rounds`` interleaved rounds after ``warmup``); ``threads``: CPU threads
    for PyTorch and ONNX Runtime (None: PyTorch's default); ``parity_images``: held-out
    images on which every backend is compared with PyTorch on the CPU in float32;
    ``torch_precision``: what the PyTorch backends run in (``fp32``, ``fp16``, ``bf16``; absent from
    reports before it was recorded, which ran fp32); ``timing``: the figure speedups and gates use
    on a GPU (:data:`~benchmarks.backends.TIMINGS`; absent from reports before format 2, which timed
    host to host); ``cuda_graphs``: the PyTorch backends on CUDA replay CUDA graphs."""

    backends: tuple[str, ...] = DEFAULT_FAMILIES
    batches: tuple[int, ...] = (1, 8, 32)
    threads: int | None = None
    warmup: int = 3
    min_time: float = 2.0
    min_rounds: int = 5
    parity_images: int = 8
    torch_precision: str = "fp32"
    timing: str = DEVICE_RESIDENT
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        check_choices("backends", self.backends, FAMILIES)
        batches = self.batches
        sizes = isinstance(batches, tuple) and all(type(size) is int and 1 <= size <= MAX_BATCH for size in batches)
        if not (sizes and batches and len(set(batches)) == len(batches)):
            raise SettingError(
                f"{{setting}} takes one or more batch sizes from 1 to {MAX_BATCH:,}, each once; "
                f"got {described(batches)}",
                "batches",
            )
        check_setting_types(self)
        for name, least in (("threads", 1), ("warmup", 0), ("min_rounds", 1), ("parity_images", 0)):
            value = getattr(self, name)
            if value is not None and value < least:
                raise SettingError(f"{{setting}} must be an integer >= {least}, got {value}", name)
        if not (math.isfinite(self.min_time) and self.min_time > 0):
            raise SettingError(f"{{setting}} must be a finite number of seconds > 0, got {self.min_time}", "min_time")
        if self.torch_precision not in TORCH_PRECISIONS:
            raise CorpError(f"torch_precision is one of {', '.join(TORCH_PRECISIONS)}, not {self.torch_precision!r}")
        if self.timing not in TIMINGS:
            raise CorpError(f"timing is one of {', '.join(TIMINGS)}, not {self.timing!r}")

    @classmethod
    def from_json(cls, value: Any, where: str) -> BenchSettings:
        settings = fields_from_json(cls, value, where)
        return settings if "timing" in value else replace(settings, timing=HOST_TO_HOST)


@dataclass(kw_only=True)
class Timing(Record):
    """One model's latency at one batch size (:func:`benchmarks.latency.summarize`): percentiles,
    mean and minimum in seconds over ``runs`` timed calls, and images per second at the median."""

    runs: int | None = None
    p50_s: float
    p90_s: float | None = None
    p99_s: float | None = None
    mean_s: float | None = None
    min_s: float | None = None
    throughput_ips: float | None = None


@dataclass(kw_only=True)
class Ratio(Record):
    """A per-round time ratio, slow / fast (:func:`benchmarks.latency.speedup`): median, 10th and
    90th percentiles, extremes, over ``rounds`` rounds."""

    median: float
    p10: float | None = None
    p90: float | None = None
    min: float | None = None
    max: float | None = None
    rounds: int | None = None


@dataclass(kw_only=True)
class Figure(Record):
    """Both models timed one way (``timing``) at one batch size, interleaved: their timings and the
    speedup (dense / compressed, per round)."""

    timing: str
    dense: Timing
    compressed: Timing
    speedup: Ratio


@dataclass(kw_only=True)
class LatencyRow(Record):
    """Both models on one backend at one batch size, timed interleaved: how (``timing``,
    :func:`benchmarks.backends.row_timings`), their timings, the speedup (dense / compressed, per
    round), the MAC-ideal speedup and ``efficiency`` = measured / ideal: the figure gates compare.
    ``second``: on a GPU, the same timed the other way (host to host beside device-resident, or the
    reverse); ``compile_s``: with ``torch.compile``, each model's compile at this batch size in
    seconds, apart from its timings. A row without ``timing`` (format 1) was timed host to host."""

    backend: str
    batch: int
    timing: str
    dense: Timing | None = None
    compressed: Timing
    speedup: Ratio
    ideal_speedup: float | None = None
    efficiency: float | None = None
    second: Figure | None = optional_entry()
    compile_s: dict[str, float] | None = optional_entry()

    @classmethod
    def from_json(cls, value: Any, where: str) -> LatencyRow:
        if isinstance(value, dict) and "timing" not in value and isinstance(value.get("backend"), str):
            value = {**value, "timing": row_timings(value["backend"], HOST_TO_HOST)[0]}
        return fields_from_json(cls, value, where)


@dataclass
class ModelEntry(Record):
    """One model's size (parameters, MACs per image), the files it was run from (None: not
    exported) and their precision, ONNX exporter and opset (None: not exported; absent from reports
    before they were recorded)."""

    params: int
    macs: int
    onnx: str | None
    engine: str | None
    precision: str | None = optional_entry()
    exporter: str | None = optional_entry()
    opset: int | None = optional_entry()


@dataclass
class BackendStatus(Record):
    """Whether a backend ran (``status`` ``ran``) or was ``skipped``, and then why."""

    status: str
    reason: str | None = optional_entry()

    @property
    def ran(self) -> bool:
        return self.status == "ran"


@dataclass
class Accuracy(Record):
    """Top-1 and top-5 accuracy on labelled images."""

    top1: float
    top5: float | None = None


@dataclass(kw_only=True)
class Fidelity(Record):
    """The compressed model against the dense one on ``images`` evaluation images
    (:class:`benchmarks.fidelity.FidelityMeter`): mean feature cosine and, with a classifier, top-1
    agreement and mean KL (else None); ``accuracy`` per model with labels (else None); ``data``
    describes the images, ``held_out`` whether calibration never saw them."""

    images: int | None = None
    feature_cosine: float | None = None
    top1_agreement: float | None = None
    kl_mean: float | None = None
    accuracy: dict[str, Accuracy] | None = None
    data: dict | None = None
    held_out: bool | None = None


@dataclass(kw_only=True)
class Int8Row(Record):
    """The four graphs of :data:`benchmarks.int8.VARIANTS` at one batch size, timed interleaved: each
    graph's timing (``timings`` by graph; in the JSON, one entry per graph), speedups over dense fp32
    (by graph) and of int8 over fp32 (by model)."""

    batch: int
    timings: dict[str, Timing] = field(default_factory=dict)
    speedup_over_dense_fp32: dict[str, Ratio] = field(default_factory=dict)
    int8_over_fp32: dict[str, Ratio] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "batch": self.batch,
            **{name: timing.to_dict() for name, timing in self.timings.items()},
            "speedup_over_dense_fp32": {name: ratio.to_dict() for name, ratio in self.speedup_over_dense_fp32.items()},
            "int8_over_fp32": {model: ratio.to_dict() for model, ratio in self.int8_over_fp32.items()},
        }

    @classmethod
    def from_json(cls, value: Any, where: str) -> Int8Row:
        row = fields_from_json(cls, value, where)  # every entry but the graphs' timings
        graphs = {name: entry for name, entry in value.items() if name not in ("batch", *_RATIOS)}
        row.timings = from_json(dict[str, Timing], graphs, where)
        return row


#: The entries of an :class:`Int8Row` that hold ratios (the others but ``batch`` are timings).
_RATIOS = ("speedup_over_dense_fp32", "int8_over_fp32")


@dataclass(kw_only=True)
class Int8Fidelity(Record):
    """One graph against the dense float32 PyTorch model: mean and smallest per-image output cosine,
    top-1 agreement (None without a classifier)."""

    cosine_mean: float
    cosine_min: float | None = None
    top1_agreement: float | None = None


@dataclass(kw_only=True)
class Int8Result(Record):
    """The int8 section (:mod:`benchmarks.int8`): ``skipped``, why it was not measured, or the
    latency rows, each graph's fidelity, file size (bytes) and how many Linear layers each int8
    graph keeps in float."""

    skipped: str | None = optional_entry()
    latency: list[Int8Row] | None = optional_entry()
    fidelity: dict[str, Int8Fidelity] | None = optional_entry()
    bytes: dict[str, int] | None = optional_entry()
    kept_float: dict[str, int] | None = optional_entry()


@dataclass
class GateResult(Record):
    """The regression gate's verdict: the ``baseline`` report it compared with (a path, or None),
    the ``limits`` (:meth:`benchmarks.gate.GateLimits.to_dict`), whether it ``passed``, and every
    regression found, in words."""

    baseline: str | None
    limits: dict
    passed: bool
    regressions: list[str]


@dataclass(kw_only=True)
class BenchReport(Document):
    """One bench run: when and where (``created``, ``machine``, library ``versions``), how
    (``settings``), both models' sizes and files (``models``, by :data:`MODELS` name), the MAC-ideal
    speedup (dense MACs / compressed MACs), each backend's status, parity (``parity[model][backend]``:
    the backend against PyTorch on the CPU), the attention kernels each PyTorch backend ran
    (``attention[backend][model]``, :func:`benchmarks.attention_kernels.kernel_summary`), latency rows,
    fidelity, when measured the int8 section and the gate's verdict, and the checksums of the
    artifact measured."""

    FORMAT = BENCH_FORMAT

    created: str | None = None
    machine: Machine | None = None
    versions: dict[str, str | None] = field(default_factory=dict)
    settings: BenchSettings | None = None
    models: dict[str, ModelEntry] = field(default_factory=dict)
    ideal_speedup: float | None = None
    backends: dict[str, BackendStatus] = field(default_factory=dict)
    parity: dict[str, dict[str, Comparison]] = field(default_factory=dict)
    attention: dict[str, dict[str, str]] = field(default_factory=dict)
    latency: list[LatencyRow]
    fidelity: Fidelity
    int8: Int8Result | None = optional_entry()
    gate: GateResult | None = optional_entry()
    #: The SHA-256 of the artifact's ``config_sha256`` and ``weights_sha256`` that were measured (its
    #: record's, the same before and after the run); absent from reports before it was recorded.
    artifact: dict[str, str] | None = optional_entry()

    def skipped_backends(self) -> dict[str, str | None]:
        """``{backend: why it was skipped}``."""
        return {name: status.reason for name, status in self.backends.items() if not status.ran}
