"""What ``export_artifact`` returns: per model, the files it wrote and how they were checked.

Typed records whose entries (``entry()``, :class:`~exporters.manifest.ModelEntry`) are exactly those
of ``export.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .manifest import ExportManifest, ModelEntry
from .parity import ParityCheck
from .tensorrt import EngineBuild


@dataclass
class ModelExport:
    """One model of an export (``model``, the compressed one, or ``dense``): its ONNX file(s),
    its engine (None until built), size, parity checks in the order they ran, the int8
    quantizer's record (int8 only) and the engine's build."""

    onnx: list[str]
    params: int
    macs: int
    parity: list[ParityCheck] = field(default_factory=list)
    int8: dict | None = None
    engine: str | None = None
    engine_build: EngineBuild | None = None

    def entry(self) -> ModelEntry:
        """The model's entry in ``export.json``."""
        return ModelEntry(
            onnx=tuple(self.onnx),
            engine=self.engine,
            params=self.params,
            macs=self.macs,
            parity={check.key: check.to_dict() for check in self.parity},
            int8=self.int8,
            engine_build=None if self.engine_build is None else self.engine_build.to_dict(),
        )


@dataclass
class ExportResult:
    """``out_dir``, the export folder; ``manifest``, its ``export.json``; ``models`` by manifest key."""

    out_dir: Path
    manifest: ExportManifest
    models: dict[str, ModelExport]
    #: Why the export is not complete here (TensorRT or a GPU missing); empty when complete.
    incomplete: list[str] = field(default_factory=list)

    def summary_table(self):
        """The parity checks as a rich table, one row per checked file (its worst batch)."""
        from rich.table import Table

        manifest = self.manifest
        table = Table(
            title=f"corp-deploy export -> {self.out_dir}",
            caption=f"{manifest.precision}, {manifest.exporter} exporter, opset {manifest.opset}",
        )
        for column in ("file", "checked against", "max abs err", "min cosine", "top-1 agree"):
            justify = "left" if column in ("file", "checked against") else "right"
            table.add_column(column, justify=justify, overflow="fold")
        for entry in self.models.values():
            for check in entry.parity:
                if check.skipped is not None:
                    table.add_row(check.file, check.reference, "not run", "", "")
                    continue
                worst = check.worst()
                table.add_row(
                    check.file,
                    check.reference,
                    f"{worst.max_abs:.2e}",
                    f"{worst.cosine:.6f}",
                    f"{worst.top1_agreement:.3f}" if worst.top1_agreement is not None else "-",
                )
        return table
