"""The first rule: models never import torch.distributed (see docs/design.md, "The two rules").

Checked statically on every file under models/ and on every veomni module (and parent package
``__init__``) those files import, transitively: ``import torch`` itself loads torch.distributed,
so a runtime check could not tell who asked for it.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
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


def _module_file(name: str) -> Path | None:
    for candidate in (
        REPO.joinpath(*name.split(".")).with_suffix(".py"),
        REPO.joinpath(*name.split("."), "__init__.py"),
    ):
        if candidate.is_file():
            return candidate
    return None


def test_models_and_their_veomni_imports_never_import_torch_distributed() -> None:
    pending = sorted((REPO / "models").rglob("*.py"))
    assert pending, "no model files found"
    seen: set[Path] = set()
    offenders = []
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(path):
            if name == "torch.distributed" or name.startswith("torch.distributed."):
                offenders.append(f"{path.relative_to(REPO)} imports {name}")
            elif name.split(".")[0] == "veomni":  # the module and the packages whose __init__ runs
                parts = name.split(".")
                pending.extend(
                    f for i in range(1, len(parts) + 1) if (f := _module_file(".".join(parts[:i])))
                )
    assert not offenders, "\n".join(offenders)
