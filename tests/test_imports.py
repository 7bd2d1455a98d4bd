"""The layering of the code (docs/architecture.md, "Floors"): every module stands above what it
imports. No import circle, every import counted (inside functions and under TYPE_CHECKING too; the
entry point loading the command line aside); no module imports the entry point; outside the command
line, whose commands load their libraries when they run, no module imports another of the project
inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("corp_deploy", "exporters", "benchmarks")
ENTRY_POINT = "corp_deploy.launch"
#: The one import inside a function outside the command line: the entry point loads the command
#: line after it has installed its signal handlers (an interrupt while torch loads ends cleanly).
LATE = {(ENTRY_POINT, "corp_deploy.cli")}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, bool, int]]:
    """``(module imported, inside a function, line)`` for every import of a project module in ``path``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - child.level + 1] + ([base] if base else []))
                named = {f"{base}.{alias.name}" for alias in child.names}
                targets = {target if target in MODULES else base for target in named}
                found.extend((target, inside, child.lineno) for target in sorted(targets) if target in MODULES)
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    target = alias.name
                    while target and target not in MODULES:
                        target = target.rpartition(".")[0]
                    if target:
                        found.append((target, inside, child.lineno))
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return [(target, inside, line) for target, inside, line in found if target != name]


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def test_the_modules_are_found():
    assert {"corp_deploy.cli", "corp_deploy.recovery.loop", "exporters.pipeline", "benchmarks.sweep"} <= set(MODULES)
    assert ("corp_deploy.outputs", False) in {(t, f) for t, f, _ in IMPORTS["corp_deploy.artifact"]}


def test_no_module_imports_another_inside_a_function_outside_the_command_line():
    late = [
        f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}"
        for name, imports in IMPORTS.items()
        for target, inside, line in imports
        if inside and not name.startswith("corp_deploy.cli") and (name, target) not in LATE
    ]
    assert late == []


def test_no_module_imports_the_entry_point():
    assert [name for name, imports in IMPORTS.items() if any(t == ENTRY_POINT for t, _, _ in imports)] == []


def test_the_imports_make_no_circle():
    edges = {
        name: {target for target, _, _ in imports if (name, target) not in LATE} for name, imports in IMPORTS.items()
    }
    done, path = set(), []

    def circle_from(name: str) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        path.append(name)
        for target in sorted(edges[name]):
            found = circle_from(target)
            if found:
                return found
        path.pop()
        done.add(name)
        return None

    circles = [circle for circle in map(circle_from, sorted(edges)) if circle]
    assert circles == []
