"""Writing single files atomically (JSON included) and checksums. Whole output directories:
:mod:`corp_deploy.outputs`."""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (a unique name, so concurrent writers never share it);
    when the block succeeds it replaces ``path`` in one rename, otherwise it is removed."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name[:64]}.tmp-", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as :func:`json_text`, atomically."""
    text = json_text(data)
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def json_text(data: Any) -> str:
    """``data`` as indented JSON. NaN and infinities, which JSON cannot hold, are written as ``null``."""
    return json.dumps(finite_or_none(data), indent=2, allow_nan=False) + "\n"


def finite_or_none(value: Any) -> Any:
    """``value`` with every NaN or infinite float (in nested dicts, lists and tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def current_umask() -> int:
    """The process's umask (reading it means setting it; it is set back at once)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask
