"""The lab (``lab/``: the studies, the photo-set builder, the helpers only studies and tests use, the
records) beside the tool: not installed, never imported by the tool, and kept from rotting unseen —
every study imports and parses its arguments (``--help``), and none imports a private name of the
tool, so a renamed function of the tool fails here, not in the next study someone runs."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ("corp_deploy", "exporters", "benchmarks")
LAB_FILES = sorted((ROOT / "lab").rglob("*.py"))
#: The lab's command lines: every study, the artifact regression gate and the photo-set builder.
COMMANDS = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in LAB_FILES
    if "__main__" in path.read_text() and path.name != "__init__.py"
)


def _imported(path: Path) -> list[tuple[str, str, int]]:
    """``(module, name, line)`` for every ``from module import name`` and ``import module`` (name "")."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.extend((node.module, alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend((alias.name, "", node.lineno) for alias in node.names)
    return found


def test_the_lab_has_its_commands():
    assert len(COMMANDS) >= 25 and "lab.unchanged_artifacts" in COMMANDS and "lab.photo_set" in COMMANDS, COMMANDS


@pytest.mark.parametrize("module", COMMANDS)
def test_every_lab_command_imports_and_parses_its_arguments(module, monkeypatch, capsys):
    """``python -m MODULE --help``, in-process: its imports of the tool resolve and its parser exits 0
    with a usage (argparse's or click's), before any measurement."""
    loaded = importlib.import_module(module)
    command = getattr(loaded, "main", None) or loaded.cli
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as exited:
        command()
    assert exited.value.code in (0, None), module
    assert "usage" in capsys.readouterr().out.lower(), module


def test_no_lab_file_imports_a_private_name_of_the_tool():
    private = [
        f"{path.relative_to(ROOT)}:{line} {module} {name}"
        for path in LAB_FILES
        for module, name, line in _imported(path)
        if module.split(".")[0] in TOOL and any(part.startswith("_") for part in [*module.split("."), name])
    ]
    assert not private, private


def test_the_tool_never_imports_the_lab():
    importing = [
        f"{path.relative_to(ROOT)}:{line}"
        for package in TOOL
        for path in sorted((ROOT / package).rglob("*.py"))
        for module, _, line in _imported(path)
        if module.split(".")[0] == "lab"
    ]
    assert not importing, importing


def test_the_installed_packages_are_the_tool_alone():
    """What ``pip install`` ships (pyproject's package list): the three packages of the tool; the lab,
    its records and the photo set's manifest are run from a checkout."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = pyproject.split("[tool.setuptools.packages.find]\n", 1)[1].split("\n[", 1)[0]
    assert packages.splitlines()[0].startswith('include = ["corp_deploy*", "exporters*", "benchmarks*"]'), packages
    assert "exclude" not in packages and "[tool.setuptools.package-data]" not in pyproject
    assert not [
        path.name for path in (ROOT / "benchmarks").iterdir() if path.suffix != ".py" and path.name != "__pycache__"
    ]
