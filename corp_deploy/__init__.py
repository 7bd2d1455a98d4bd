"""corp-deploy: one-shot CORP structured pruning of timm Vision Transformers.

Public API::

    model, report = corp_deploy.compress(model, calibration_batches, CompressConfig(...))
    corp_deploy.save_artifact(model, out_dir, ...)
    model = corp_deploy.load_compressed(out_dir)
    dense = corp_deploy.load_base_model(out_dir)   # the model it was compressed from
"""
__version__ = "0.1.0"

from .artifact import latest_artifact, load_base_model, load_compressed, read_config, save_artifact
from .calibration import CalibrationImages, model_transform
from .config import CompressConfig
from .cost import count_macs, count_params
from .dims import kept_count
from .engine import compress
from .errors import CorpError
from .families import blocks_of, standard_form
from .layers import BlockDims, GatedLinear, PrunedAttention, head_dims
from .methods import METHODS, Method
from .models import create_base_model, is_plain_attention, is_prunable_attention, resolve_model_name

__all__ = [
    "BlockDims", "CalibrationImages", "CompressConfig", "CorpError", "GatedLinear", "METHODS", "Method",
    "PrunedAttention", "blocks_of", "compress", "count_macs", "count_params", "create_base_model", "head_dims",
    "is_plain_attention", "is_prunable_attention", "kept_count", "latest_artifact", "load_base_model",
    "load_compressed", "model_transform", "read_config", "resolve_model_name", "save_artifact", "standard_form",
]
