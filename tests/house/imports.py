"""The project's import graph, read statically from every file (lazy imports inside functions
included), for the house tests: the two rules, the zoo's allow-list, no cycles, and the package
graph that docs/design.md draws."""

from __future__ import annotations

import ast
import subprocess
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def imports(path: Path) -> set[str]:
    """Absolute module names imported by ``path`` (``from x import y`` yields ``x`` and ``x.y``)."""
    names: set[str] = set()
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base]) if base else ".".join(parent)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def module_file(name: str) -> Path | None:
    """The file that defines module ``name`` in this repository, if any."""
    for candidate in (REPO.joinpath(*name.split(".")).with_suffix(".py"),
                      REPO.joinpath(*name.split("."), "__init__.py")):
        if candidate.is_file():
            return candidate
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_files(*folders: str) -> list[Path]:
    """The tracked Python files under ``folders`` (all of them when none is named)."""
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.split()
    files = [REPO / f for f in listed if (REPO / f).is_file()]
    return [f for f in files if not folders or f.relative_to(REPO).parts[0] in folders]


@cache
def module_graph() -> dict[str, frozenset[str]]:
    """Module -> the project modules it imports. ``from pkg import name`` counts as ``pkg.name`` when
    that is a module; a module's own parent packages (``from . import sibling``) are left out: Python
    runs them first whoever imports the module, so they are no edge of the module's own."""
    graph = {}
    for path in python_files("veomni", "models"):
        me = module_name(path)
        graph[me] = frozenset(name for name in imports(path) if module_file(name) is not None
                              and name != me and not me.startswith(name + "."))
    return graph


def engine_package(module: str) -> str:
    """The engine package a module belongs to: ``veomni.train.fault.guard`` -> ``veomni.train``;
    a module directly under ``veomni/`` (``veomni.launch``) is a package of its own."""
    return ".".join(module.split(".")[:2])
