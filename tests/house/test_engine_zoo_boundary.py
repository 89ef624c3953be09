"""The second rule: the engine never imports the zoo, and the zoo depends only downwards, on an
allow-list: the model contract, the kernels and the tasks (see docs/design.md, "The two rules").
Checked statically on every import, lazy ones included."""

from __future__ import annotations

from tests.house.imports import REPO, imports, python_files

ZOO_MAY_IMPORT = ("veomni.contract", "veomni.ops", "veomni.tasks")


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_engine_never_imports_the_zoo() -> None:
    offenders = [f"{path.relative_to(REPO)} imports {name}" for path in python_files("veomni")
                 for name in sorted(imports(path)) if _within(name, ("models",))]
    assert not offenders, "\n".join(offenders)


def test_the_zoo_imports_only_the_contract_the_kernels_and_the_tasks() -> None:
    offenders = [f"{path.relative_to(REPO)} imports {name}: a model may import only {', '.join(ZOO_MAY_IMPORT)}"
                 for path in python_files("models")
                 for name in sorted(imports(path))
                 if name.split(".")[0] == "veomni" and name != "veomni" and not _within(name, ZOO_MAY_IMPORT)]
    assert not offenders, "\n".join(offenders)


def test_tests_scripts_and_the_harness_keep_to_their_side() -> None:
    """The shared harness sits below both tests and scripts; the library imports none of them."""
    rules = {("veomni", "models"): ("tests", "scripts", "harness"), ("scripts", "harness"): ("tests",)}
    offenders = [f"{path.relative_to(REPO)} imports {name}"
                 for folders, forbidden in rules.items() for path in python_files(*folders)
                 for name in sorted(imports(path)) if _within(name, forbidden)]
    assert not offenders, "\n".join(offenders)


def test_generic_pipelining_imports_no_modality_wing() -> None:
    """The pipeline package reaches the media and graph wings only through ``StageHooks``, which
    the wiring layer (``veomni/parallel/apply.py``) fills in."""
    wings = ("veomni.parallel.media", "veomni.parallel.graph")
    offenders = [f"{path.relative_to(REPO)} imports {name}" for path in python_files("veomni")
                 if path.parent == REPO / "veomni" / "parallel" / "pipeline"
                 for name in sorted(imports(path)) if _within(name, wings)]
    assert not offenders, "\n".join(offenders)
