"""The second rule: the engine never imports the zoo, and the zoo depends only downwards (see
docs/design.md, "The two rules"). Checked statically on every import, lazy ones included."""

from __future__ import annotations

from tests.house.test_models_have_no_distributed_imports import REPO, _imports

ENGINE_INTERNALS = ("veomni.train", "veomni.data", "veomni.checkpoint")


def _offenders(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(REPO)} imports {name}"
            for path in sorted((REPO / folder).rglob("*.py"))
            for name in sorted(_imports(path))
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


def test_the_engine_never_imports_the_zoo() -> None:
    assert not _offenders("veomni", ("models",))


def test_models_import_no_trainer_loader_or_checkpoint_code() -> None:
    assert not _offenders("models", ENGINE_INTERNALS)


def test_generic_pipelining_imports_no_modality_wing() -> None:
    """The pipeline package reaches the media and graph wings only through ``StageHooks``, which
    the wiring layer (``veomni/parallel/apply.py``) fills in."""
    assert not _offenders("veomni/parallel/pipeline", ("veomni.parallel.media", "veomni.parallel.graph"))
