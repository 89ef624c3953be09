"""The plug-in contract is checked at launch: a family missing something the engine will call is
refused before any worker starts, with the member and the docs section named.

The family is the shipped outside example (``examples/regression_family``), complete, then with
one gap planted at a time: a task without a member the engine calls, a cost model without one, a
pipeline run whose ``blocks_option`` names no config field. All in one process (no training).
"""

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from veomni.contract import build_model, get_model_spec, load_plugins, register_model
from veomni.contract.deprecated import PluginAPIDeprecation
from veomni.contract.plugin_check import plugin_problems
from veomni.launch import main as launch_main

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "regression_family"


class _Without:
    """A task or cost model that delegates to a complete one, except for one member."""

    def __init__(self, inner, missing: str) -> None:
        self._inner, self._missing = inner, missing

    def __getattr__(self, name):
        if name == self._missing:
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __call__(self, *args, **kwargs):
        return self._inner(*args, **kwargs)


@pytest.fixture(scope="module")
def toy():
    load_plugins([str(EXAMPLE / "toy_regression")])
    spec = get_model_spec("toy_regressor")
    with torch.device("meta"):
        config, model = build_model("toy_regressor", {})
    return spec, config, model


def test_the_complete_family_passes(toy):
    spec, config, model = toy
    assert plugin_problems(spec, config, model, pp=1) == []


@pytest.mark.parametrize("member", ["baseline_stats", "baseline_loss", "prepare", "count_loss_units", "contract"])
def test_a_task_without_a_member_is_refused(toy, member):
    spec, config, model = toy
    gap = dataclasses.replace(spec, task=lambda cfg: _Without(spec.task(cfg), member))
    problems = plugin_problems(gap, config, model, pp=1)
    assert len(problems) == 1 and f"`{member}`" in problems[0] and "docs/adding_a_model.md" in problems[0]


def test_a_previous_release_task_passes_the_check_and_runs_adapted_with_a_warning(toy):
    """``prepare`` without ``training`` and no ``output_metrics`` (the previous release's task): not
    refused, even under pipelines, but adapted by ``ModelSpec.build_task``, each gap named."""
    spec, config, model = toy

    class PreviousRelease(type(spec.task(config))):
        output_metrics = None  # not callable: the member is absent

        def prepare(self, batch, generator=None):
            return {**batch, "generator": generator}

    old = dataclasses.replace(spec, task=lambda cfg: PreviousRelease(cfg.input_noise), blocks_option="num_blocks")
    assert plugin_problems(old, config, model, pp=1) == [] and plugin_problems(old, config, model, pp=2) == []
    with pytest.warns(PluginAPIDeprecation) as caught:
        task = old.build_task(config)
    said = " ".join(str(w.message) for w in caught)
    assert "takes no `training` keyword" in said and "no `output_metrics" in said and "section 3" in said
    batch = {"x": torch.ones(2, 3), "y": torch.ones(2, 1)}
    assert task.prepare(batch, "g", training=False)["generator"] == "g"
    assert task.output_metrics(torch.ones(2, 1), torch.ones(2, 1)) == {}
    assert task.count_loss_units(batch) == 2  # the rest is the task's own
    current = spec.build_task(config)
    assert type(current) is type(spec.task(config)), "a current task is not wrapped"


def test_output_loss_is_needed_only_under_pipelines(toy):
    spec, config, model = toy
    gap = dataclasses.replace(spec, task=lambda cfg: _Without(spec.task(cfg), "output_loss"),
                              blocks_option="num_blocks")
    assert plugin_problems(gap, config, model, pp=1) == []
    assert "`output_loss`" in plugin_problems(gap, config, model, pp=2)[0]


def test_a_cost_model_without_a_member_is_refused(toy):
    spec, config, model = toy
    gap = dataclasses.replace(spec, cost=_Without(spec.cost, "activated_params"))
    assert ["`activated_params`" in p and "section 5" in p for p in plugin_problems(gap, config, model, pp=1)] == [True]


def test_blocks_option_must_name_a_config_field_under_pipelines(toy):
    spec, config, model = toy  # the example registers no blocks_option: the default is num_layers
    problems = plugin_problems(spec, config, model, pp=2)
    assert len(problems) == 1 and "blocks_option='num_layers'" in problems[0] and "section 6" in problems[0]
    assert plugin_problems(dataclasses.replace(spec, blocks_option="num_blocks"), config, model, pp=2) == []


def test_the_launcher_refuses_a_gap_before_any_worker_starts(toy, tmp_path, capsys):
    spec, _, _ = toy
    register_model(dataclasses.replace(spec, name="toy_without_baseline",
                                       task=lambda cfg: _Without(spec.task(cfg), "baseline_loss")))
    shutil.copytree(EXAMPLE, tmp_path / "family", ignore=shutil.ignore_patterns("data", "outputs", "__pycache__"))
    recipe = tmp_path / "family" / "recipe.yaml"
    assert launch_main([str(recipe), "--model.arch", "toy_without_baseline", "--launcher-world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "has no `baseline_loss`" in err and "docs/adding_a_model.md" in err
    assert not (tmp_path / "family" / "data").exists()  # refused before data.prepare ran


def test_a_wrong_plugins_flag_is_blamed_on_the_command_line(tmp_path, capsys):
    shutil.copytree(EXAMPLE, tmp_path / "family", ignore=shutil.ignore_patterns("data", "outputs", "__pycache__"))
    recipe = tmp_path / "family" / "recipe.yaml"
    assert launch_main([str(recipe), "--dry-run", "--model.plugins", "[./no_such_family]"]) == 2
    err = capsys.readouterr().err
    assert "--model.plugins" in err and "no_such_family" in err and "recipe.yaml:" not in err
