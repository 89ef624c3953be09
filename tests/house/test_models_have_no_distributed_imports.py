"""The first rule: models never import torch.distributed (see docs/design.md, "The two rules").

Checked statically on every file under models/ and on every veomni module (and parent package
``__init__``) those files import, transitively: ``import torch`` itself loads torch.distributed,
so a runtime check could not tell who asked for it.
"""

from __future__ import annotations

from pathlib import Path

from tests.house.imports import REPO, imports, module_file


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
        for name in imports(path):
            if name == "torch.distributed" or name.startswith("torch.distributed."):
                offenders.append(f"{path.relative_to(REPO)} imports {name}")
            elif name.split(".")[0] == "veomni":  # the module and the packages whose __init__ runs
                parts = name.split(".")
                pending.extend(
                    f for i in range(1, len(parts) + 1) if (f := module_file(".".join(parts[:i])))
                )
    assert not offenders, "\n".join(offenders)
