"""``export.json``: what an export directory holds, how it was made and how well it matched."""
from __future__ import annotations

import json
import platform
from pathlib import Path

from corp_deploy import CorpError
from corp_deploy.files import sha256_file

MANIFEST = "export.json"
FORMAT = "corp-deploy-export"
FORMAT_VERSION = 1


def file_entries(folder: Path) -> list[dict]:
    """``{"name", "bytes", "sha256"}`` of every file under ``folder`` except the manifest, sorted."""
    return [{"name": p.relative_to(folder).as_posix(), "bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST]


def versions() -> dict:
    """Versions of the libraries an export depends on (``tensorrt`` is None where it is missing)."""
    import onnx
    import onnxruntime
    import polygraphy
    import timm
    import torch

    import corp_deploy
    from .tensorrt import tensorrt_version
    return {"corp_deploy": corp_deploy.__version__, "torch": torch.__version__, "timm": timm.__version__,
            "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
            "polygraphy": polygraphy.__version__, "tensorrt": tensorrt_version(),
            "python": platform.python_version()}


def read_manifest(folder: str | Path) -> dict:
    """The validated ``export.json`` of an export directory."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CorpError(f"{folder} is not a corp-deploy export (no {MANIFEST})") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CorpError(f"cannot read {path}: {exc}") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise CorpError(f"{path} is not a corp-deploy export manifest of version {FORMAT_VERSION}")
    return manifest

