"""Output directories that corp-deploy owns: written atomically, recorded, verified.

Every directory the tool writes (an artifact, an export, a sweep, a bench report folder) is
built under a temporary name beside its destination and holds, when complete, a record
(:data:`RECORD_FILE`) listing every file in it with its size and SHA-256. The record is what
makes an output *recognisably the tool's own*:

- an existing destination is replaced only when it is empty, or when it is an output of the
  same kind whose files all still match its record (folders inside it must be outputs of the
  kinds it holds, :data:`HOLDS`: an artifact's ``export-fp32/``); anything else is refused with
  one message naming what is in the way, and nothing is touched;
- an output is never written inside another one (whose record would not list it), except an
  export inside the artifact it is made from;
- the old output is deleted file by file from its record, never by a recursive delete;
- readers verify the files they use against the record (:func:`verify_files`), so a flipped
  byte, files from another output or an edited ``config.json`` are refused, naming the file.

The record is an integrity check against corruption and mix-ups, not a signature: whoever
can rewrite the files can rewrite the record too.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .documents import DocumentFormat, timestamp
from .errors import CorpError
from .files import NAME_IN_TEMP, checked_path, current_umask, sha256_file, write_json
from .interrupts import signals_deferred
from .resources import check_disk

RECORD_FILE = "corp-deploy-record.json"
RECORD = DocumentFormat("corp-deploy-record", 1, "output", "write it again", file=RECORD_FILE)
#: The kinds of output and what they are called in messages.
KINDS = {"artifact": "an artifact", "export": "an export", "sweep": "a sweep", "bench": "a bench report"}
#: The kinds of output that an output of each kind may hold as folders (an artifact its exports, a
#: sweep its artifacts): removed with it. Any other output inside an output is refused.
HOLDS = {"artifact": ("export",), "sweep": ("artifact",), "export": (), "bench": ()}
#: The names of the folders a run works in beside its output (:func:`staged_output`): left only
#: by a run that was killed (SIGKILL) or that is still running.
STAGING_NAME = re.compile(r"^\..+\.(tmp|old)-")


def check_output_dir(dest: str | Path, kind: str, made_from: str | Path | None = None) -> Path:
    """Where an output of ``kind`` would be written for ``-o dest``: the resolved path (a symlinked
    ``dest`` is followed, so the link keeps pointing at the new output).

    CorpError, before any work is done, when the output could not be written or would replace
    something the tool did not write: a file or a foreign directory in the way, a parent that is a
    file or cannot be written, a name the file system refuses, the file system root, or the current
    directory (or one that contains it); or when it would lie inside another output (whose record
    would not list it, and whose replacement would remove it), except an export directly inside
    the artifact it is ``made_from`` (:data:`HOLDS`).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown output kind {kind!r}")
    given = checked_path(dest, f"the output path of {KINDS[kind]}")  # not "" (the current directory), UTF-8
    path = resolve(given)
    if path == Path(path.anchor):
        raise CorpError(f"output directory {given} is the file system root; choose a folder for the output")
    cwd = Path.cwd().resolve()
    if path == cwd or path in cwd.parents:
        raise CorpError(
            f"output directory {given} is the current directory or contains it; choose another "
            "folder (the output replaces the whole directory)"
        )
    check_creatable(path, given)
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise CorpError(f"output path {given} exists and is not a directory; refusing to replace it")
        with _directory_lock(path.parent):  # a consistent view while another corp-deploy run swaps it
            problem = foreign_content(path, kind)
        if problem is not None:
            raise CorpError(
                f"refusing to write {KINDS[kind]} to {given}: {problem}; nothing was changed. "
                "Move it away or choose another -o"
            )
    owner = enclosing_output(path)
    if owner is not None and not (made_from is not None and owner == path.parent == resolve(made_from)):
        raise CorpError(
            f"{given} lies inside {owner}, an output of corp-deploy: its record would not list "
            f"{KINDS[kind]} there, and replacing it would remove it; choose a folder outside it"
            + (" (an export goes inside the artifact it is made from)" if kind == "export" else "")
        )
    note_planned(path)
    return path


@dataclass
class NotedOutputs:
    """What a command did to its outputs (:func:`noting_outputs`): ``planned``, those it checked it
    could write (:func:`check_output_dir`, before the work); ``completed``, those put in place,
    complete, in order (:func:`mark_complete`); ``abandoned``, those it was writing when it failed or
    was stopped, removed, each with whether an older output at that path was kept as it was."""

    planned: list[Path] = field(default_factory=list)
    completed: list[Path] = field(default_factory=list)
    abandoned: list[tuple[Path, bool, Path]] = field(default_factory=list)  # (output, older kept, staging)
    #: the folders whose file system was full when an output was abandoned (:func:`full_folders`): the
    #: one it was staged in and the temporary directory, as the failure left them, before the cleanup
    full: list[Path] = field(default_factory=list)

    def abandon(self, dest: Path, staging: Path) -> None:
        """Note that the output ``dest`` was not written (its ``staging`` folder is about to be
        removed), and which folders' file systems were full at that moment (:func:`full_folders`)."""
        self.abandoned.append((dest, dest.exists(), staging))
        self.full += [folder for folder in full_folders(dest.parent) if folder not in self.full]

    def being_written(self) -> list[Path]:
        """The outputs the command was writing when it failed: those abandoned, but those inside
        another abandoned output's staging folder (a sweep's artifacts: they went with it)."""
        stagings = [staging for _, _, staging in self.abandoned]
        return [path for path, _, _ in self.abandoned if not any(staging in path.parents for staging in stagings)]

    def in_place(self) -> list[Path]:
        """The completed outputs still in place: not one completed inside another output's staging
        folder that was removed since (a sweep's artifacts)."""
        return [path for path in self.completed if path.exists()]

    def left_behind(self) -> list[tuple[Path, bool]]:
        """``(output, older one kept)`` of the outputs not written: those abandoned and those planned
        but not begun, but those that were to be written inside another abandoned output's staging
        folder (a sweep's artifacts): they go with it."""
        stagings = [staging for _, _, staging in self.abandoned]
        begun = set(self.completed) | {path for path, _, _ in self.abandoned}
        not_begun = [(path, path.exists(), path) for path in self.planned if path not in begun]
        return [
            (path, kept)
            for path, kept, _ in [*self.abandoned, *not_begun]
            if not any(staging in path.parents for staging in stagings)
        ]


#: For each command being run (nested in tests that run one inside another), what it did to its outputs.
_NOTED: list[NotedOutputs] = []


@contextmanager
def noting_outputs() -> Iterator[NotedOutputs]:
    """Collect the outputs put in place, complete, and those abandoned within the block: a step that
    fails afterwards, or an interrupt, must say which, not that something may have been written."""
    noted = NotedOutputs()
    _NOTED.append(noted)
    try:
        yield noted
    finally:
        _NOTED.pop()


def note_planned(path: Path) -> None:
    """Note that the command will write the output ``path`` (resolved; checked before the work), so
    that an interrupt before it is begun names it too (see :func:`noting_outputs`)."""
    if _NOTED and path not in _NOTED[-1].planned:
        _NOTED[-1].planned.append(path)


def mark_complete(path: str | Path) -> None:
    """Note that the output ``path`` is in place and complete (see :func:`noting_outputs`)."""
    if _NOTED:
        _NOTED[-1].completed.append(Path(path))


def enclosing_output(path: str | Path) -> Path | None:
    """The nearest folder above ``path`` (resolved) that holds an output's record, or None."""
    return next((folder for folder in Path(path).parents if (folder / RECORD_FILE).is_file()), None)


@contextmanager
def staged_output(dest: str | Path, kind: str, needs: int = 0, made_from: str | Path | None = None) -> Iterator[Path]:
    """Build an output of ``kind`` beside ``dest`` and move it to ``dest`` only when the block succeeds.

    ``made_from``: the artifact an export is made from, inside which it may lie (see
    :func:`check_output_dir`). ``needs``: a lower bound on the bytes the new output will hold;
    CorpError, before anything is written, when the file system of ``dest`` has less free space.
    An output it replaces keeps its room until the new one is complete, so what it occupies is not
    counted as free.

    Yields the staging directory to write into (flat files; folders inside it must be outputs of
    their own). On success the record is written, permissions are set from the umask, and the
    staging directory replaces ``dest`` (see :func:`check_output_dir` for what may be replaced;
    checked again at the swap, under a lock that serialises concurrent corp-deploy writers: the
    last one wins). On any exception, including an interrupt, the staging directory is removed
    and ``dest`` is left as it was.
    """
    dest = check_output_dir(dest, kind, made_from)
    _check_room(dest, kind, needs)
    created = [folder for folder in (dest.parent, *dest.parent.parents) if not folder.exists()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name[:NAME_IN_TEMP]}.tmp-", dir=dest.parent))
    swapped = False
    try:
        yield tmp
        write_record(tmp, kind)
        _apply_umask(tmp)
        with _directory_lock(dest.parent), signals_deferred():  # waiting for the lock stays interruptible
            leftover = _swap_into_place(tmp, dest, kind)
            swapped = True
            mark_complete(dest)
        if leftover is not None:
            warnings.warn(leftover, stacklevel=2)
    except BaseException:
        with signals_deferred():
            if not swapped:  # once in place, the staging name is no longer ours
                if _NOTED:  # before the cleanup, which frees what a full file system lacked
                    _NOTED[-1].abandon(dest, tmp)
                shutil.rmtree(tmp, ignore_errors=True)
            for folder in created:  # the parents this run made, innermost first, if still empty
                with contextlib.suppress(OSError):
                    folder.rmdir()
        raise


#: Free space below which a file system counts as full where a write failed: a write refused for want
#: of room leaves less than one of its buffers.
FULL_BELOW = 2**20


def full_folders(staging_parent: Path) -> list[Path]:
    """Of ``staging_parent`` (where an output is staged) and the temporary directory (``$TMPDIR``, where
    exports keep their scratch files), those on a file system with less than :data:`FULL_BELOW` bytes
    free."""
    folders = [staging_parent]
    with contextlib.suppress(OSError):  # no usable temporary directory at all
        folders.append(Path(tempfile.gettempdir()))
    return [folder for folder in dict.fromkeys(folders) if _free_bytes(folder) < FULL_BELOW]


def _free_bytes(folder: Path) -> float:
    """The free space of ``folder``'s file system (infinite where it cannot be read: a folder removed)."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return math.inf


def _check_room(dest: Path, kind: str, needs: int) -> None:
    """CorpError when the file system of ``dest`` has fewer than ``needs`` bytes free."""
    if needs <= 0:
        return
    replacing = dest.exists()
    check_disk(
        f"writing {KINDS[kind]} to {dest}",
        needs,
        _nearest_existing(dest.parent),
        "free some space or choose another -o"
        + (
            " (the output there is removed only once the new one is complete: both need room at once)"
            if replacing
            else ""
        ),
    )


def write_record(folder: Path, kind: str) -> dict:
    """Write ``folder``'s record: every file in it (not in the folders inside it, which must be
    outputs with records of their own) with its size and SHA-256."""
    files = {}
    for entry in sorted(folder.iterdir()):
        if entry.name == RECORD_FILE:
            continue
        if entry.is_symlink() or not (entry.is_file() or entry.is_dir()):
            raise CorpError(f"{entry} is not a regular file; an output holds files and outputs only")
        if entry.is_dir():
            if read_record(entry) is None:
                raise CorpError(f"{entry} is a folder without a corp-deploy record inside an output")
            continue
        files[entry.name] = {"bytes": entry.stat().st_size, "sha256": sha256_file(entry)}
    record = {**RECORD.header(), "kind": kind, "created": timestamp(), "files": files}
    write_json(folder / RECORD_FILE, record)
    return record


def read_record(folder: Path) -> dict | None:
    """``folder``'s record, or None when it has none that this corp-deploy can read. A record whose
    file names are not plain names inside the folder is not read: it could point anywhere."""
    path = Path(folder) / RECORD_FILE
    if path.is_symlink() or not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: nested deeper than Python parses
        return None
    if not isinstance(record, dict):
        return None
    files = record.get("files")
    if (
        RECORD.problem(record, path) is not None
        or record.get("kind") not in KINDS
        or not isinstance(files, dict)
        or not all(
            _plain_name(name)
            and name != RECORD_FILE
            and isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and isinstance(entry.get("bytes"), int)
            for name, entry in files.items()
        )
    ):
        return None
    return record


def verify_files(folder: str | Path, kind: str, names: list[str] | tuple[str, ...] | None = None) -> dict:
    """Check that ``folder`` is an output of ``kind`` and that the files ``names`` (default: every
    recorded file) are present, plain files inside it, and match their recorded SHA-256.

    Returns the record; CorpError naming the first file that fails."""
    folder = Path(folder)
    record = _record_of(folder, kind)
    for name in record["files"] if names is None else names:
        path = _recorded_path(folder, record, name)
        if sha256_file(path) != record["files"][name]["sha256"]:
            raise _changed(path)
    return record


def read_verified(folder: str | Path, kind: str, name: str) -> bytes:
    """The bytes of the file ``name`` of the output ``folder`` of ``kind``, read once and checked
    against the record (what is checked is what is used); CorpError naming the file otherwise."""
    folder = Path(folder)
    record = _record_of(folder, kind)
    path = _recorded_path(folder, record, name)
    data = path.read_bytes()
    entry = record["files"][name]
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise _changed(path)
    return data


def read_recorded_json(folder: str | Path, kind: str, document: DocumentFormat) -> dict:
    """The JSON file ``document.file`` of the output ``folder`` of ``kind``, checked against the
    output's record, of ``document``'s format in a version read here; CorpError naming the file
    otherwise."""
    folder = Path(folder)
    path = folder / document.file
    try:  # a first look for the version, so that an older output (without a record) gets the message that helps
        earlier = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        earlier = None
    if isinstance(earlier, dict) and earlier.get("format") == document.name:
        document.check(earlier, path)
    try:
        data = json.loads(read_verified(folder, kind, document.file))  # what is used is what was checked
    except (ValueError, RecursionError):
        data = None
    return document.check(data, path)


def _record_of(folder: Path, kind: str) -> dict:
    """``folder``'s record, of ``kind``; CorpError otherwise."""
    record = read_record(folder)
    if record is None:
        raise CorpError(
            f"{folder} has no readable {RECORD_FILE}: it was not written by this version of "
            f"corp-deploy, or the record is damaged; write it again"
        )
    if record["kind"] != kind:
        raise CorpError(f"{folder} is {KINDS[record['kind']]}, not {KINDS[kind]}")
    return record


def _recorded_path(folder: Path, record: dict, name: str) -> Path:
    """``folder / name``: a regular file listed in ``record``, of the recorded size; CorpError otherwise."""
    entry = record["files"].get(name)
    if entry is None:  # (recorded names are plain names inside the folder: read_record)
        raise CorpError(f"{folder / name} is not listed in {folder / RECORD_FILE}")
    path = folder / name
    if path.is_symlink():
        raise CorpError(
            f"{path} is a symbolic link, not the file corp-deploy wrote (listed in {RECORD_FILE}); "
            "an output's files are read only as written, so put the file itself back"
        )
    if not path.is_file():
        raise CorpError(f"{path} is missing (it is listed in {RECORD_FILE})")
    if path.stat().st_size != entry["bytes"]:
        raise _changed(path)
    return path


def _changed(path: Path) -> CorpError:
    return CorpError(
        f"{path} does not match the SHA-256 that corp-deploy recorded when it wrote it "
        "(changed or corrupted since); write it again"
    )


def foreign_content(folder: Path, kind: str) -> str | None:
    """Why ``folder`` is not an output of ``kind`` that may be replaced, or None when it may (it is
    empty or gone, or every file in it is recorded and unchanged and every folder in it is an output
    too)."""
    try:
        if not any(folder.iterdir()):
            return None
    except FileNotFoundError:  # another writer is swapping it right now: checked again at the swap
        return None
    record = read_record(folder)
    if record is None:
        return (
            f"it is not empty and holds no {RECORD_FILE} that corp-deploy can read (not an output of "
            "corp-deploy, or one whose record is gone)"
        )
    if record["kind"] != kind:
        return f"it holds {KINDS[record['kind']]}, not {KINDS[kind]}"
    return _unrecorded(folder, record)


def _unrecorded(folder: Path, record: dict) -> str | None:
    """The first thing in ``folder`` that its record does not account for, in words; None if none."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} cannot be changed (not writable), so the old output could not be removed"
    for entry in sorted(folder.iterdir()):
        if entry.name == RECORD_FILE:
            continue
        if entry.is_symlink() or not (entry.is_file() or entry.is_dir()):
            return f"{entry} is not a file corp-deploy wrote"
        if entry.is_dir():
            inner = read_record(entry)
            if inner is None and STAGING_NAME.match(entry.name):
                return (
                    f"{entry} is the working folder of a corp-deploy run that was killed or is still running; "
                    "delete it once no run writes there"
                )
            if inner is None:
                return f"{entry} is a folder without a readable {RECORD_FILE}"
            if inner["kind"] not in HOLDS[record["kind"]]:
                return (
                    f"{entry} is {KINDS[inner['kind']]}, which corp-deploy never writes inside "
                    f"{KINDS[record['kind']]} (replacing it would remove it)"
                )
            problem = _unrecorded(entry, inner)
            if problem is not None:
                return problem
            continue
        recorded = record["files"].get(entry.name)
        if recorded is None:
            return f"{entry} was not written by corp-deploy"
        if not _as_recorded(entry, recorded):
            return f"{entry} has changed since corp-deploy wrote it"
    return None


def _as_recorded(path: Path, recorded: dict) -> bool:
    """Whether ``path`` is a regular file of the size and SHA-256 its record gives."""
    return (
        not path.is_symlink()
        and path.is_file()
        and path.stat().st_size == recorded["bytes"]
        and sha256_file(path) == recorded["sha256"]
    )


def _remove_output(folder: Path) -> list[str]:
    """Delete an output that :func:`foreign_content` accepted: its recorded files, its inner outputs,
    its record and the folder itself. Each file is checked against its record again right before it
    is deleted (the record itself: still the one read at the start), so that one changed since the
    check is kept. Returns what could not be removed (the
    file system refused, or it changed or appeared meanwhile), which is left in place."""
    record = read_record(folder)
    problems = []
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink() and read_record(entry) is not None:
            problems += _remove_output(entry)
    files = (record or {}).get("files", {})
    for name in [*files, RECORD_FILE]:
        path = folder / name
        if not (path.is_symlink() or path.exists()):
            continue
        intact = _as_recorded(path, files[name]) if name != RECORD_FILE else read_record(folder) == record
        if not intact:
            problems.append(f"{path.relative_to(folder.parent)}: changed since it was checked")
            continue
        try:
            path.unlink()
        except OSError as exc:
            problems.append(f"{path.relative_to(folder.parent)}: {exc.strerror or exc}")
    try:
        folder.rmdir()
    except OSError as exc:
        if not problems:
            problems.append(f"{folder.name}: {exc.strerror or exc}")
    return problems


def _swap_into_place(new: Path, dest: Path, kind: str) -> str | None:
    """Move the finished output ``new`` to ``dest``, replacing an output there that may be replaced
    (checked again here); returns what of the old output could not be removed, in words, or None."""
    if dest.is_dir() and not any(dest.iterdir()):
        os.rename(new, dest)  # replaces the empty directory atomically
        return None
    if dest.exists() or dest.is_symlink():
        problem = "it is not a directory" if dest.is_symlink() or not dest.is_dir() else foreign_content(dest, kind)
        if problem is not None:
            raise CorpError(
                f"refusing to replace {dest}: {problem} (it changed while this run worked); nothing was changed"
            )
        old = dest.with_name(f".{dest.name[:NAME_IN_TEMP]}.old-{os.getpid()}-{time.time_ns()}")
        os.rename(dest, old)
        try:
            os.rename(new, dest)
        except BaseException:
            os.rename(old, dest)
            raise
        problems = _remove_output(old)
        if problems:
            return (
                f"the new output is in place, but the old one could not be removed completely: {old} is "
                f"left ({'; '.join(problems[:3])}); delete it once you have checked it"
            )
        return None
    os.rename(new, dest)
    return None


@contextmanager
def _directory_lock(folder: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``folder`` (serialises corp-deploy writers swapping outputs in it);
    no lock where the file system does not support one."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def check_apart(outputs: list[str | Path], inputs: dict[str, str | Path | None]) -> None:
    """CorpError when an output path is an input folder or lies inside one (the run would replace
    what it reads, or a later run would read the tool's own files as its images); ``inputs`` by the
    name the message gives them (an option, ``ARTIFACT``), None where not given."""
    for output in map(resolve, outputs):
        for name, folder in inputs.items():
            if folder is None:
                continue
            folder = resolve(folder)
            if output == folder:
                raise CorpError(f"{output} is {name} itself, which this command reads; write the output elsewhere")
            if folder in output.parents:
                raise CorpError(f"{output} lies inside {name} {folder}, which this command reads; write it elsewhere")


def resolve(path: str | Path) -> Path:
    """``path`` made absolute with its symlinks followed; CorpError for a symlink loop."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError) as exc:
        raise CorpError(f"{path} cannot be resolved ({getattr(exc, 'strerror', None) or exc})") from None


def check_creatable(path: Path, given: str | Path | None = None) -> None:
    """CorpError unless ``path`` (resolved) could be created: every existing ancestor is a directory,
    the nearest one is writable (checked by creating and removing a folder there), and the name is
    within the file system's limit. ``given``: the path as the user wrote it, for messages."""
    given = path if given is None else given
    existing = _nearest_existing(path.parent)
    if not existing.is_dir():
        raise CorpError(f"cannot create {given}: {existing} is a file, not a directory")
    limit = _name_max(existing)
    length = len(os.fsencode(path.name))
    if length > limit:
        raise CorpError(f"cannot create {given}: the name is {length} bytes long and the file system allows {limit}")
    try:
        with signals_deferred():  # the probe folder never outlives this line
            os.rmdir(tempfile.mkdtemp(prefix=".corp-deploy-probe-", dir=existing))
    except OSError as exc:
        raise CorpError(
            f"cannot create {given}: {existing} is not writable ({exc.strerror or type(exc).__name__})"
        ) from None


def _plain_name(name: str) -> bool:
    """Whether ``name`` is one file name (no folder, no ``..``), so that a record never points
    outside its folder (manifest names are checked against the record)."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def _apply_umask(folder: Path) -> None:
    """Give the finished tree ordinary permissions (mkdtemp creates it 0700); files that were
    made executable stay executable."""
    umask = current_umask()
    for root, _, files in os.walk(folder):
        Path(root).chmod(0o777 & ~umask)
        for name in files:
            file = Path(root) / name
            mode = 0o777 if file.stat().st_mode & 0o100 else 0o666
            file.chmod(mode & ~umask)
