"""A plug-in written against the previous release's names still runs, with a deprecation warning.

The family (``legacy_plugin/legacy_regression.py``) imports ``veomni.spec``, ``veomni.parallel.plan``
and ``veomni.data.registry``, and its task has the old ``prepare(batch, generator)`` and no
``output_metrics``. The launcher's check passes and says what to change; two training steps and an
eval run in one process (a forked gloo rank); each old module path gives the very objects of the
new one, with a warning naming it.
"""

from __future__ import annotations

import importlib
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

from harness.gloo_ranks import run_distributed
from veomni.contract.deprecated import CompatibleTask, PluginAPIDeprecation
from veomni.launch import main as launch_main

RECIPE = Path(__file__).with_name("legacy_plugin") / "recipe.yaml"
MOVED = [("veomni.spec", "veomni.contract", "ModelSpec"),
         ("veomni.spec.registry", "veomni.contract.families", "register_model"),
         ("veomni.spec.hooks", "veomni.contract.hooks", "MoEHooks"),
         ("veomni.spec.media", "veomni.contract.media", "MediaHost"),
         ("veomni.parallel.plan", "veomni.contract.plan", "ParallelPlan"),
         ("veomni.data.registry", "veomni.data.kinds", "ResumableDataset")]


@pytest.fixture
def fresh_shims():
    """The old modules imported anew (a shim warns when it is first imported in a process)."""
    def forget():
        for old, _, _ in MOVED:
            sys.modules.pop(old, None)
    forget()
    yield
    forget()


@pytest.mark.parametrize(("old", "new", "name"), MOVED)
def test_an_old_module_path_gives_the_new_objects_and_names_the_new_path(fresh_shims, old, new, name):
    with pytest.warns(PluginAPIDeprecation) as caught:  # a submodule's package (veomni.spec) warns too
        module = importlib.import_module(old)
    assert any(str(w.message).startswith(f"{old} moved to {new}: ") for w in caught), [str(w.message) for w in caught]
    assert issubclass(PluginAPIDeprecation, DeprecationWarning)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def _data(folder: Path) -> list[str]:
    generator = torch.Generator().manual_seed(0)
    for split, rows in (("train", 64), ("eval", 32)):
        x = torch.randn(rows, 4, generator=generator)
        torch.save({"x": x, "y": x.sum(1, keepdim=True)}, folder / f"{split}.pt")
    return ["--data.train_path", str(folder / "train.pt"), "--data.eval_path", str(folder / "eval.pt"),
            "--train.output_dir", str(folder / "out")]


def _train_two_steps(rank: int, world: int, overrides: list[str]) -> dict:
    from veomni.config.load import load_config
    from veomni.train.trainer import Trainer

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PluginAPIDeprecation)
        trainer = Trainer(load_config(str(RECIPE), overrides))
    losses = [trainer.run_step()["loss"] for _ in range(2)]
    noisy_in_training = trainer.task.task.noisy_batches
    evaluated = trainer.evaluate()
    trainer.save_checkpoint()
    return {"losses": losses, "eval": evaluated, "wrapped": isinstance(trainer.task, CompatibleTask),
            "noisy": (noisy_in_training, trainer.task.task.noisy_batches), "said": [str(w.message) for w in caught]}


def test_a_plugin_written_against_the_previous_release_launches_and_trains(fresh_shims, tmp_path, capsys):
    overrides = _data(tmp_path)
    assert launch_main([str(RECIPE), *overrides]) == 0
    said = capsys.readouterr().err
    for old, new, _ in MOVED[::4]:  # the three the family imports
        assert f"[launch] deprecated: {old} moved to {new}" in said, said
    assert "takes no `training` keyword" in said and "has no `output_metrics" in said, said

    result = run_distributed(_train_two_steps, 1, overrides)[0]
    assert result["wrapped"] and all(math.isfinite(loss) for loss in result["losses"])
    assert math.isfinite(result["eval"]["eval_loss"]) and result["eval"]["eval_baseline"] > 0
    in_training, in_all = result["noisy"]
    assert in_all > in_training >= 2, "as in the previous release, its augmentation runs on eval batches too"
    assert any("takes no `training` keyword" in message for message in result["said"]), result["said"]
    assert (tmp_path / "out" / "checkpoints").is_dir()
