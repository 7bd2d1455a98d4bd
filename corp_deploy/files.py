"""Atomic output: directories built under a temporary name and renamed into place, JSON, checksums."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from .errors import CorpError


@contextmanager
def staged_directory(dest: str | Path, marker: str) -> Iterator[Path]:
    """Build a directory beside ``dest`` and move it to ``dest`` only when the block succeeds.

    Yields the temporary directory to write into. On success its permissions are set from
    the umask and it replaces ``dest``; on any exception it is removed and ``dest`` is left
    as it was, so a failed run never leaves a directory that looks complete. An existing
    ``dest`` is replaced only when it is empty or holds ``marker`` (a file that only this
    kind of output has); any other directory is refused with :class:`CorpError`.
    """
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise CorpError(f"output path {dest} exists and is not a directory")
    if dest.is_dir() and any(dest.iterdir()) and not (dest / marker).is_file():
        raise CorpError(f"output directory {dest} exists, is not empty and was not written by "
                        f"corp-deploy (no {marker}); refusing to overwrite it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
        _apply_umask(tmp)
        _replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON, atomically (temporary file + rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _replace_dir(new: Path, dest: Path) -> None:
    """Move the finished directory ``new`` to ``dest``, replacing an old one."""
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}-{time.time_ns()}")
        dest.rename(old)
    new.rename(dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _apply_umask(folder: Path) -> None:
    """Give the finished tree ordinary permissions (mkdtemp creates it 0700); files that were
    made executable stay executable."""
    umask = os.umask(0)
    os.umask(umask)
    for root, _, files in os.walk(folder):
        Path(root).chmod(0o777 & ~umask)
        for name in files:
            file = Path(root) / name
            mode = 0o777 if file.stat().st_mode & 0o100 else 0o666
            file.chmod(mode & ~umask)
