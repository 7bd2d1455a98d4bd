"""The JSON documents corp-deploy writes: each names its format and version, records where it came
from, and is checked when it is read.

A document (an artifact's ``config.json`` and ``report.json``, an export's ``export.json``, a bench
report, a sweep's ``sweep.json``) begins with ``"format"`` and ``"format_version"``
(:class:`DocumentFormat`). Its provenance is when it was written (:func:`timestamp`), the versions
of the libraries that made it (:func:`library_versions`) and, for measurements, the machine
(:class:`Machine`). A reader refuses another format, a version it does not read, and a missing or
mistyped entry with one :class:`~corp_deploy.errors.CorpError` that names the file and the problem.

Typed documents are dataclasses: a :class:`Record` is one JSON object whose entries are its fields,
in order; a :class:`Document` is a record that is a whole file. Reading checks every entry against
its field's type:

- ``str``, ``int``, ``bool``: that JSON type (``true`` is not an integer);
- ``float``: a number, or null, read as NaN (:func:`corp_deploy.files.json_text` writes NaN and
  infinities as null);
- ``X | None``: null or an ``X``; ``list[X]``, ``tuple[X, ...]`` (a JSON list), ``dict[str, X]``;
  a plain ``dict`` or ``Any``: any value of that JSON type, unchecked inside; ``Path``: a string;
- a dataclass: an object, each field an entry, recursively; an entry may be missing where its
  field has a default, and entries without a field are ignored.

An :func:`optional_entry` is left out of the object while it is None. A record whose JSON shape is
not its fields overrides :meth:`Record.to_dict` and the classmethod ``from_json(value, where)``.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import platform
import time
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar

from . import __version__
from .errors import CorpError, first_line

#: The libraries an artifact's weights depend on (``config.json``'s ``versions``), besides Python
#: and corp-deploy itself.
ARTIFACT_LIBRARIES = ("torch", "timm", "safetensors", "numpy")


def timestamp() -> str:
    """Now, local time, as every document records it: ``2025-01-31T14:05:09+0100``."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def library_versions(libraries: tuple[str, ...] = ARTIFACT_LIBRARIES, optional: tuple[str, ...] = ()) -> dict:
    """``{"corp_deploy": version, <library>: version, ..., "python": version}``, the libraries in the
    order given, then the ``optional`` ones (None where one cannot be imported here)."""
    return {
        "corp_deploy": __version__,
        **{name: importlib.import_module(name).__version__ for name in libraries},
        **{name: _optional_version(name) for name in optional},
        "python": platform.python_version(),
    }


def _optional_version(name: str) -> str | None:
    try:
        return importlib.import_module(name).__version__
    except Exception:  # an optional library can fail to import in many ways (no driver, no GPU, a placeholder)
        return None


class Malformed(CorpError):
    """An entry of a document that is missing or of the wrong type; the message names it (without the
    file, which :meth:`Document.from_dict` adds)."""


@dataclass(frozen=True)
class DocumentFormat:
    """What a document's first two entries say: its format ``name`` (``corp-deploy-bench``) and the
    ``version`` written now.

    ``title`` is what messages call it (``bench report``); ``file`` its fixed file name, if it has
    one (``config.json``); ``again`` what to do with a version this corp-deploy does not read
    (``compress the model again``). ``also_reads`` lists the older versions still read; None in it
    stands for a document without ``format_version`` and, with ``reads_unnamed``, for one without
    ``format`` as well (written before the format was named).
    """

    name: str
    version: int
    title: str
    again: str
    file: str | None = None
    also_reads: tuple[int | None, ...] = ()
    reads_unnamed: bool = False

    def header(self) -> dict:
        """The document's first two entries."""
        return {"format": self.name, "format_version": self.version}

    def check(self, data: Any, source: str | Path) -> dict:
        """``data`` (parsed JSON) when it is a document of this format in a version read here;
        CorpError naming ``source`` otherwise."""
        problem = self.problem(data, source)
        if problem is not None:
            raise CorpError(problem)
        return data

    def problem(self, data: Any, source: str | Path) -> str | None:
        """Why ``data``, the document ``source``, is not a readable document of this format, in words
        that name it; None when it is one."""
        unnamed = isinstance(data, dict) and "format" not in data and "format_version" not in data
        if not isinstance(data, dict) or (data.get("format") != self.name and not (unnamed and self.reads_unnamed)):
            what = f"the {self.file} of a corp-deploy" if self.file is not None else "a corp-deploy"
            return f"{source} is not {what} {self.title}"
        found = data.get("format_version")
        if found != self.version and found not in self.also_reads:
            readable = ", ".join(str(v) for v in (self.version, *self.also_reads) if v is not None)
            return (
                f"{source}: {self.title} format version {found!r} is not supported by this corp-deploy (reads "
                f"version {readable}); {self.again}"
            )
        return None


def read_json(path: str | Path, what: str, expected: str = "a JSON file") -> Any:
    """The parsed JSON of the file ``path``; CorpError naming it (``what PATH``) when it is missing,
    a directory (``expected`` says what it should be), or not JSON."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CorpError(f"{what} {path} not found") from None
    except IsADirectoryError:
        raise CorpError(f"{what} {path} is a directory, not {expected}") from None
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python parses
        raise CorpError(f"cannot read {what} {path}: {first_line(exc)}") from None


#: The field metadata that marks an :func:`optional_entry`.
_OPTIONAL = "corp_deploy.documents.optional"


def optional_entry() -> Any:
    """A record field (default None) whose entry the JSON object has only while it is not None."""
    return field(default=None, metadata={_OPTIONAL: True})


class Record:
    """A dataclass that is one JSON object: its fields, in order, are the object's entries (an
    :func:`optional_entry` only while it is set)."""

    def to_dict(self) -> dict:
        """The JSON object (nested records as objects, tuples as lists, paths as strings)."""
        return {
            f.name: to_json(getattr(self, f.name))
            for f in fields(self)
            if not (f.metadata.get(_OPTIONAL) and getattr(self, f.name) is None)
        }

    @classmethod
    def from_dict(cls, data: Any):
        """The record of a JSON object, every entry checked (:mod:`corp_deploy.documents`);
        :class:`Malformed` naming the first bad entry."""
        return from_json(cls, data, "")


class Document(Record):
    """A record that is a whole file: its format's header first (:attr:`FORMAT`), then its fields."""

    FORMAT: ClassVar[DocumentFormat]

    def to_dict(self) -> dict:
        return {**self.FORMAT.header(), **super().to_dict()}

    @classmethod
    def from_dict(cls, data: Any, source: str | Path = "the document"):
        """The document of parsed JSON ``data``, its format, version and entries checked; one
        CorpError naming ``source`` (the file) and the problem otherwise."""
        cls.FORMAT.check(data, source)
        try:
            return fields_from_json(cls, data, "")
        except Malformed as exc:
            raise CorpError(f"{source} is malformed: {exc}") from None

    @classmethod
    def read(cls, path: str | Path):
        """The document in the file ``path`` (:meth:`from_dict`)."""
        return cls.from_dict(read_json(path, cls.FORMAT.title), path)


@dataclass(frozen=True)
class Machine(Record):
    """What ran a measurement: platform, CPU model and cores, PyTorch's threads, GPU (None without one)."""

    platform: str
    cpu: str
    cpu_count: int | None
    torch_threads: int
    gpu: str | None

    @classmethod
    def here(cls) -> Machine:
        import torch

        cpu = platform.processor()
        try:
            with open("/proc/cpuinfo") as f:
                cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
        except OSError:
            pass
        return cls(
            platform=platform.platform(),
            cpu=cpu,
            cpu_count=os.cpu_count(),
            torch_threads=torch.get_num_threads(),
            gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        )


def to_json(value: Any) -> Any:
    """``value`` as JSON-ready data: records (anything with ``to_dict``) and dataclasses as objects,
    tuples as lists, paths as strings."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {key: to_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    return value


_JSON_TYPES = {str: "a string", int: "an integer", float: "a number", bool: "true or false", Path: "a path"}


def from_json(kind: Any, value: Any, where: str) -> Any:
    """``value`` (parsed JSON) as the type ``kind`` (see :mod:`corp_deploy.documents`); :class:`Malformed`
    naming ``where`` (``latency row 0.speedup``) when it is not one."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = [option for option in args if option is not type(None)]
        if value is None and len(options) < len(args):
            return None
        (kind,) = options  # one type besides None: the documents need no other unions
        return from_json(kind, value, where)
    if kind is float:
        if value is None:
            return math.nan
        _expect(isinstance(value, (int, float)) and not isinstance(value, bool), kind, value, where)
        return value
    if kind in (str, int, bool):
        _expect(isinstance(value, kind) and (kind is bool or not isinstance(value, bool)), kind, value, where)
        return value
    if kind is Path:
        _expect(isinstance(value, str), kind, value, where)
        return Path(value)
    if origin in (list, tuple) or kind in (list, tuple):
        _expect(isinstance(value, list), "a list", value, where)
        item = args[0] if args else Any
        items = [from_json(item, v, _item(where, i, item)) for i, v in enumerate(value)]
        return items if origin is list or kind is list else tuple(items)
    if origin is dict or kind is dict:
        _expect(isinstance(value, dict), "an object", value, where)
        item = args[1] if args else Any
        return {key: from_json(item, v, f"{where}.{key}" if where else key) for key, v in value.items()}
    if is_dataclass(kind):
        custom = getattr(kind, "from_json", None)
        if custom is not None:
            return custom(value, where)
        if isinstance(kind, type) and issubclass(kind, Document):
            problem = kind.FORMAT.problem(value, where or "it")
            if problem is not None:
                raise Malformed(problem)
        return fields_from_json(kind, value, where)
    raise TypeError(f"documents cannot hold {kind!r}")


def fields_from_json(cls: type, data: Any, where: str) -> Any:
    """The dataclass ``cls`` from the JSON object ``data``, one field per entry (what :func:`from_json`
    does for a dataclass without a ``from_json`` of its own, and what such a one can build on)."""
    _expect(isinstance(data, dict), "an object", data, where)
    hints = typing.get_type_hints(cls)
    values = {}
    for f in fields(cls):
        if not f.init:
            continue
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise Malformed(f"{where or 'it'} lacks {f.name}")
            continue
        values[f.name] = from_json(hints[f.name], data[f.name], f"{where}.{f.name}" if where else f.name)
    try:
        return cls(**values)
    except CorpError as exc:  # the record's own checks (__post_init__)
        raise Malformed(f"{where}: {exc}" if where else str(exc)) from None


def _item(where: str, index: int, kind: Any) -> str:
    """How a list item is named: ``latency row 0`` for records (a table's rows), ``onnx[0]`` otherwise."""
    return f"{where} row {index}" if is_dataclass(kind) else f"{where}[{index}]"


def _expect(ok: bool, kind: Any, value: Any, where: str) -> None:
    if not ok:
        wanted = _JSON_TYPES.get(kind, kind)
        found = "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)
        if isinstance(value, (list, dict)):
            found = "a list" if isinstance(value, list) else "an object"
        raise Malformed(f"{where or 'it'} must be {wanted}, not {found}")
