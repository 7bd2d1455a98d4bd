"""The most recent artifact ``compress`` wrote, remembered in the state folder (:func:`state_dir`)
for the commands run without an artifact path (:func:`record_latest`, :func:`latest_artifact`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .artifact import read_config
from .documents import timestamp
from .errors import CorpError
from .files import write_json

#: The record of the most recent artifact, in :func:`state_dir`.
LATEST_FILE = "latest.json"


def state_dir() -> Path | None:
    """Where corp-deploy remembers the most recent artifact: ``$CORP_DEPLOY_STATE_DIR``, else
    ``$XDG_STATE_HOME/corp-deploy``, else ``$HOME/.local/state/corp-deploy``; None (no state is kept)
    when none of them is set. An empty or relative ``$XDG_STATE_HOME`` or ``$HOME`` counts as unset,
    as the XDG Base Directory specification says of the first (it would move with the current
    directory; an empty ``$HOME`` would put the state at the file system's root)."""
    if os.environ.get("CORP_DEPLOY_STATE_DIR"):
        return Path(os.environ["CORP_DEPLOY_STATE_DIR"])
    for variable, below in (("XDG_STATE_HOME", ()), ("HOME", (".local", "state"))):
        base = os.environ.get(variable, "")
        if os.path.isabs(base):
            return Path(base, *below, "corp-deploy")
    return None


#: Why there is no state folder (:func:`state_dir` is None), for messages.
NO_STATE = (
    "none of CORP_DEPLOY_STATE_DIR, XDG_STATE_HOME and HOME is set to an absolute path, so corp-deploy keeps "
    "no record of the most recent artifact"
)


def record_latest(path: str | Path) -> str | None:
    """Remember ``path`` as the most recent artifact (for commands run without a path).

    Atomic, under a unique temporary name, so concurrent runs never lose the record: the last
    writer wins. Returns None, or why the record could not be written (the run itself is not
    failed for that)."""
    folder = state_dir()
    if folder is None:
        return f"{NO_STATE}: pass {path} to the commands that follow"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / LATEST_FILE, {"artifact": str(Path(path).resolve()), "time": timestamp()})
    except OSError as exc:
        return f"could not record {path} as the latest artifact in {folder / LATEST_FILE}: {exc}"
    return None


def latest_artifact() -> Path:
    """The most recent artifact written by ``compress``; CorpError if none is known."""
    folder = state_dir()
    if folder is None:
        raise CorpError(f"no artifact given, and {NO_STATE}; pass the artifact directory")
    record = folder / LATEST_FILE
    try:
        text = record.read_text()
    except FileNotFoundError:
        raise CorpError(
            "no artifact given and none recorded; run `corp-deploy compress` first or pass the artifact directory"
        ) from None
    except OSError as exc:
        raise CorpError(f"cannot read {record}: {exc.strerror or exc}") from None
    try:
        state = json.loads(text)
    except (ValueError, RecursionError):
        state, problem = None, "malformed JSON"
    else:
        path = state.get("artifact") if isinstance(state, dict) else None
        problem = None if isinstance(path, str) else 'no "artifact" path in it'
    if problem is not None:
        raise CorpError(
            f"{record} is not a corp-deploy state record ({problem}); remove it and pass the artifact directory"
        )
    try:
        read_config(path)
    except CorpError as exc:
        raise CorpError(
            f"the most recent artifact ({record} records it) cannot be used: {exc}; pass the artifact directory"
        ) from None
    return Path(path)
