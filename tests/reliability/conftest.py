"""The reliability cases' fixtures: the small artifacts built once per module (``built``) and each
case's own copy of them as its current and temporary directory (``work``)."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from tests.reliability.common import invoke


@pytest.fixture(scope="module")
def built(tiny_artifact, other_tiny_artifact, tmp_path_factory):
    """A copy of the small compressed artifact with its dense fp32 export inside (``art``), and a
    copy of the second artifact of the same shapes (another seed; ``other``)."""
    root = tmp_path_factory.mktemp("built")
    shutil.copytree(tiny_artifact, root / "art")
    shutil.copytree(other_tiny_artifact, root / "other")
    code, text, _ = invoke(["export", root / "art", "--dense"], root / "state")
    assert code == 0, text
    return root


@pytest.fixture
def work(tmp_path, built, monkeypatch):
    """The case's folder: a copy of the built artifacts, the current directory, and the temporary
    directory of everything run in-process (checked empty afterwards)."""
    w = tmp_path / "w"
    w.mkdir()
    for name in ("art", "other"):
        shutil.copytree(built / name, w / name)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.chdir(w)
    yield w
    assert list(temp.iterdir()) == [], "temporary files left behind"
