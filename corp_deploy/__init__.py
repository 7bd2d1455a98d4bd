"""corp-deploy: one-shot CORP structured pruning of timm Vision Transformers.

Public API::

    model, report = corp_deploy.compress(model, calibration_batches, CompressConfig(...))
    corp_deploy.save_artifact(model, out_dir, ...)
    result = corp_deploy.compress_to_artifact(model, CompressConfig(...), CalibrationSpec(...), out_dir)
    model = corp_deploy.load_compressed(out_dir)
    dense = corp_deploy.load_base_model(out_dir)   # the model it was compressed from
"""

__version__ = "0.1.0"

import importlib

#: The public API and the module each name lives in. Imported on first use, so that importing the
#: package (and the command's launcher, :mod:`corp_deploy.launch`) does not import torch and timm.
_API = {
    "Artifact": "artifact",
    "ArtifactConfig": "artifact_config",
    "latest_artifact": "latest",
    "load_base_model": "artifact",
    "load_compressed": "artifact",
    "read_config": "artifact",
    "read_report": "artifact",
    "save_artifact": "artifact",
    "CalibrationImages": "calibration",
    "CalibrationSpec": "calibration",
    "CompressConfig": "config",
    "count_macs": "cost",
    "count_params": "cost",
    "kept_count": "dims",
    "compress": "engine",
    "CorpError": "errors",
    "blocks_of": "families",
    "is_plain_attention": "families",
    "is_prunable_attention": "families",
    "standard_form": "families",
    "BlockDims": "layers",
    "GatedLinear": "layers",
    "PrunedAttention": "layers",
    "head_dims": "layers",
    "multi_head_attention": "layers",
    "METHODS": "methods",
    "Method": "methods",
    "CorpOptions": "methods",
    "ToastOptions": "methods",
    "VbpOptions": "methods",
    "create_base_model": "models",
    "model_transform": "models",
    "PARTS": "parts",
    "Part": "parts",
    "TARGETS": "parts",
    "resolve_model_name": "models",
    "CompressedArtifact": "workflow",
    "ImagesInMemory": "workflow",
    "compress_to_artifact": "workflow",
    "recover_artifact": "workflow",
    "RecoveryConfig": "recovery",
    "recover": "recovery",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
