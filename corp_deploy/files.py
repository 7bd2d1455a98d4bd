"""Writing single files atomically (JSON included) and checksums. Whole output directories:
:mod:`corp_deploy.outputs`."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import BadUsage, CorpError
from .interrupts import signals_deferred

#: Temporary names carry at most this much of the final name, so that a name near the file
#: system's limit still leaves room for the suffix.
NAME_IN_TEMP = 64


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (a unique name, so concurrent writers never share it);
    when the block succeeds it replaces ``path`` in one rename, otherwise it is removed."""
    with atomic_files([path]) as temporary:
        yield temporary[Path(path)]


@contextmanager
def atomic_files(paths: Iterable[str | Path]) -> Iterator[dict[Path, Path]]:
    """Yield ``{path: temporary path beside it}``; when the block succeeds every temporary file
    replaces its path, one rename each, with interrupts held until the last one is in place (so an
    interrupt never leaves some replaced and others not); when the block fails they are all removed
    and no path is touched."""
    temporary = {}
    try:
        for path in map(Path, paths):
            fd, name = tempfile.mkstemp(prefix=f".{path.name[:NAME_IN_TEMP]}.tmp-", suffix=path.suffix, dir=path.parent)
            os.close(fd)
            temporary[path] = Path(name)
        yield temporary
        with signals_deferred():
            for path, tmp in list(temporary.items()):
                os.chmod(tmp, 0o666 & ~current_umask())
                os.replace(tmp, path)
                del temporary[path]  # in place: its temporary name is no longer ours
    finally:
        with signals_deferred():
            for tmp in temporary.values():
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


def checked_path(value: object, name: str) -> Path:
    """``value``, a path the tool takes, as a :class:`Path`; BadUsage naming it as ``name`` when it
    is not a str or an ``os.PathLike`` of one (bytes neither), is empty (it would name the current
    directory), or is not valid UTF-8 once made absolute (a relative path in a folder whose name is
    not): every path is recorded as text (JSON, Markdown, the latest-artifact state), and safetensors
    and ONNX Runtime take UTF-8 paths only, so such an output could not be read back."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise BadUsage(f"{name} must be a str or a pathlib.Path, not {type(value).__name__}")
    if not text:
        raise BadUsage(f"{name} is empty: an empty path names no file or folder")
    path = Path(text)
    if shown(path.absolute()) != str(path.absolute()):
        raise BadUsage(
            f"{name} {shown(path.absolute())} is not valid UTF-8: corp-deploy records paths as text, and the "
            "libraries it runs (safetensors, ONNX Runtime) take UTF-8 paths only; rename the folder or file"
        )
    return path


def shown(path: str | Path) -> str:
    """``path`` as text that any output can hold: the bytes of a name that is not valid UTF-8 (which
    Python holds as lone surrogates) written as ``\\xff``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def existing_dir(path: str | Path, what: str) -> Path:
    """``path`` made absolute (so that what is recorded resolves the same from anywhere), or
    CorpError ``WHAT PATH: not found`` or ``not a directory`` (BadUsage for what is not a path the
    tool can take: :func:`checked_path`)."""
    path = checked_path(path, what)
    if not path.is_dir():
        raise CorpError(f"{what} {path}: {'not a directory' if path.exists() else 'not found'}")
    return path.resolve()


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
