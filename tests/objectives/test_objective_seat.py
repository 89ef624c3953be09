"""The objective seat: ``sft`` hands the family's task over untouched, objectives register by
name (a plug-in adds one), bad choices are refused at launch, and a preference objective's
reference is the starting model (a frozen copy, or under LoRA the base with its adapters off)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from tests.objectives.pairs import packed_pairs, pair_tokens
from tests.parity_utils import assert_scalar_parity, tiny_model
from veomni.adapters.lora import adapters_disabled, add_lora
from veomni.config.schema import LoraConfig, RunConfig
from veomni.data.packing import pack_samples
from veomni.objectives import FrozenModels, ObjectiveRequest, build_objective, objective_problems
from veomni.objectives.registry import Objective, register_objective
from veomni.tasks.lm import LanguageModelingTask


def _run_config(objective: str = "sft", **train) -> RunConfig:
    cfg = RunConfig()
    cfg.train.objective = objective
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def test_sft_is_the_default_and_hands_over_the_family_task_itself() -> None:
    """Bit-identical to before objectives: the trainer gets the very task object, no wrapper."""
    task = LanguageModelingTask()
    objective = build_objective(ObjectiveRequest(RunConfig(), task))
    assert RunConfig().train.objective == "sft"
    assert objective.task is task and objective.attach is None


def test_a_plugin_registers_an_objective_and_unknown_or_unsupported_ones_are_refused() -> None:
    register_objective("test_only_wrapped", lambda request: Objective("test_only_wrapped", request.task))
    task = LanguageModelingTask()
    assert build_objective(ObjectiveRequest(_run_config("test_only_wrapped"), task)).task is task
    problems = objective_problems(_run_config("dpp"), "chat_preference")
    assert len(problems) == 1 and "'dpp'" in problems[0] and "did you mean 'dpo'" in problems[0]
    cfg = _run_config("dpo")
    cfg.parallel.pp = 2
    assert objective_problems(cfg, "chat_preference") == []  # a pipeline with whole rows
    cfg.parallel.sp = 2
    assert "whole rows only" in objective_problems(cfg, "chat_preference")[0]
    register_objective("test_only_unpipelined", lambda request: Objective("test_only_unpipelined", request.task))
    cfg.train.objective, cfg.parallel.sp = "test_only_unpipelined", 1
    assert "does not run under a pipeline" in objective_problems(cfg, "chat_preference")[0]
    assert "set data.kind" in objective_problems(_run_config("dpo"), "chat_text")[0]
    assert objective_problems(_run_config("dpo"), "chat_preference") == []


@pytest.mark.parametrize("lora, colocate, refused", [(0, True, True), (8, True, False), (0, False, False)])
def test_a_frozen_copy_of_a_vlm_with_encoders_outside_the_pipeline_stages_is_refused_at_launch(
        lora: int, colocate: bool, refused: bool) -> None:
    """The builder cannot cut a frozen copy whose encoders run apart from the stages: the launcher
    says so (and the two fixes) before any worker starts; with LoRA or the encoders in stage 0, no."""
    from veomni.config.load import load_config
    from veomni.launch import _validate_model

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "preference" / "tiny_vqa_dpo.yaml"
    cfg = load_config(recipe, ["--parallel.pp", "2", "--lora.rank", str(lora),
                               "--parallel.encoder_colocate", str(colocate).lower()])
    *_, problems = _validate_model(cfg)
    named = [p for p in problems if "keeps a frozen copy of the model" in p]
    assert bool(named) == refused, problems
    assert not refused or ("lora.rank > 0" in named[0] and "parallel.encoder_colocate false" in named[0])


def _frozen_models(policy: torch.nn.Module, adapters: bool, built: list[int]) -> FrozenModels:
    start = copy.deepcopy(policy)

    def frozen_copy() -> torch.nn.Module:
        built.append(1)
        return start.requires_grad_(False).eval()

    return FrozenModels(policy, frozen_copy, adapters, None)


@pytest.mark.parametrize("loss", ["dpo", "ipo"])
def test_the_reference_is_the_starting_model_so_the_first_loss_is_the_indifferent_one(loss: str) -> None:
    """At the start policy = reference: every log-ratio is 0, DPO's loss is ln 2 and IPO's 1/(4 beta^2);
    the reference gets no gradient and is built once."""
    cfg = _run_config(loss)
    objective = build_objective(ObjectiveRequest(cfg, LanguageModelingTask()))
    policy, built = tiny_model(), []
    objective.attach(_frozen_models(policy, False, built))
    batch = objective.task.prepare(packed_pairs(pair_tokens(3)))
    out = objective.task(policy, batch)
    beta = cfg.preference.beta
    expected = math.log(2) if loss == "dpo" else 1 / (4 * beta**2)
    assert out.loss_units == 3 and built == [1]
    assert_scalar_parity(float(out.loss_sum.detach()) / 3, expected, f"{loss} loss at policy = reference")
    out.loss_sum.backward()
    assert all(p.grad is not None for p in policy.parameters())
    assert float(out.metrics["rewards_margin"][0]) == 0.0


def test_under_lora_the_reference_is_the_base_with_adapters_off_and_no_copy_is_built() -> None:
    base = tiny_model()
    policy = add_lora(copy.deepcopy(base), LoraConfig(rank=4))
    with torch.no_grad():  # trained adapters: the policy now differs from its base
        for name, param in policy.named_parameters():
            if name.endswith("lora_B") or name.endswith("lora_A"):
                param.normal_(0, 0.2)
    objective = build_objective(ObjectiveRequest(_run_config("dpo"), LanguageModelingTask()))
    built: list[int] = []
    objective.attach(_frozen_models(policy, True, built))
    task = objective.task
    batch = task.prepare(packed_pairs(pair_tokens(2)))
    assert built == []
    reference = task.reference(batch)
    base_logps = task.token_logps(base, batch)
    assert torch.equal(reference, base_logps)
    assert not torch.equal(task.token_logps(policy, batch), base_logps), "adapters back on after the reference"
    with adapters_disabled(policy):
        assert torch.equal(task.token_logps(policy, batch), base_logps)


def test_an_odd_sample_count_is_refused() -> None:
    objective = build_objective(ObjectiveRequest(_run_config("simpo"), LanguageModelingTask()))
    prompt, chosen, _ = pair_tokens(1)[0]

    with pytest.raises(ValueError, match="pairs"):
        objective.task.prepare(pack_samples([prompt + chosen]))
