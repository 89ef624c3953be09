"""The plug-in contract, checked at launch: every member of a family's task, model and cost model
that the engine will call, before any worker starts.

A family written from ``docs/adding_a_model.md`` that left one out used to find it by crashing:
a task without ``baseline_stats`` trained every step and died in the final eval; a spec whose
``blocks_option`` named no config field crashed ``--dry-run --parallel.pp 2``. The launcher
builds the task (on the meta device, as the model) and checks each member here; every problem
names the member, the object that lacks it and the section of the docs that describes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from veomni.contract.families import ModelSpec
from veomni.contract.graph_model import message_passing_modules
from veomni.contract.hooks import expert_modules
from veomni.contract.plan import flatten_plan
from veomni.tasks.base import BatchContract

DOC = "docs/adding_a_model.md"
TASK_MEMBERS = ("prepare", "count_loss_units", "baseline_stats", "baseline_loss")
PIPELINE_TASK_MEMBERS = ("output_loss",)  # a task without output_metrics is adapted (contract/deprecated.py)
MODEL_MEMBERS = ("parallel_plan", "init_weights")
COST_MEMBERS = ("batch_flops", "sample_flops", "activation_bytes_per_unit", "activated_params", "report_lines")


def _missing(owner: Any, names: tuple[str, ...]) -> list[str]:
    return [name for name in names if not callable(getattr(owner, name, None))]


def _option_exists(config: Any, dotted: str) -> bool:
    """Whether ``dotted`` (``llm.num_layers``) names a field of the config dataclass, section by section; a
    section held as a dict (the omni family's ``llm`` options) is the family's own to check."""
    for name in dotted.split("."):
        if isinstance(config, dict):
            return True
        if not dataclasses.is_dataclass(config) or name not in {f.name for f in dataclasses.fields(config)}:
            return False
        config = getattr(config, name)
    return True


def task_problems(spec: ModelSpec, task: Any, pp: int) -> list[str]:
    """What the task lacks for this run: the members every run calls, and with ``pp > 1`` a pipeline's
    (for a task whose contract names a ``stage_input``; one that names none is refused by
    ``check_pipeline_task``, which says the task does not pipeline at all)."""
    where = f"the task of model family {spec.name!r} ({type(task).__name__})"
    contract = getattr(task, "contract", None)
    problems = []
    if not isinstance(contract, BatchContract):
        problems.append(f"{where} has no `contract` (a veomni.tasks.BatchContract): see {DOC}, section 3")
    if not callable(task):
        problems.append(f"{where} is not callable: `__call__(model, batch) -> LossOutput` (see {DOC}, section 3)")
    pipelined = pp > 1 and isinstance(contract, BatchContract) and contract.stage_input is not None
    for name in _missing(task, TASK_MEMBERS + (PIPELINE_TASK_MEMBERS if pipelined else ())):
        problems.append(f"{where} has no `{name}`, which the engine calls{' under parallel.pp' if pipelined else ''}"
                        f": see the task table in {DOC}, section 3")
    if pipelined and contract.target is None:
        problems.append(f"parallel.pp={pp}: {where} declares no `contract.target` for the last stage's "
                        f"output_loss: see {DOC}, 'What it does not give for free'")
    return problems


def plan_hook_problems(model: nn.Module) -> list[str]:
    """The plan's expert and message-passing modules that do not declare the hooks every run injects
    into (``ExpertGroup`` in a ``MoELayer``, ``MessagePassingLayer``). Attention modules are checked
    where sequence or context parallelism needs them (``check_sequence_parallel``)."""
    plan = flatten_plan(model.parallel_plan())
    problems = []
    for declared, patterns in ((expert_modules, plan.experts), (message_passing_modules, plan.message_passing)):
        try:
            declared(model, patterns)
        except TypeError as error:
            problems.append(str(error))
    return problems


def plugin_problems(spec: ModelSpec, model_config: Any, model: nn.Module, pp: int) -> list[str]:
    """Everything of the family's contract this run would call and cannot: the task (built here on the
    meta device), the model's hooks and its plan modules' (``plan_hook_problems``), the cost model,
    and under pipelines the block-count option the memory estimate sets. Empty when the family is
    complete for this run."""
    with torch.device("meta"):
        task = spec.task(model_config)
    problems = task_problems(spec, task, pp)
    missing = _missing(model, MODEL_MEMBERS)
    problems += [f"model family {spec.name!r}: {type(model).__name__} has no `{name}()`: see {DOC}, section 2"
                 for name in missing]
    if "parallel_plan" not in missing:
        problems += plan_hook_problems(model)
    problems += [f"model family {spec.name!r}: its cost model {type(spec.cost).__name__} has no `{name}`: "
                 f"see {DOC}, section 5" for name in _missing(spec.cost, COST_MEMBERS)]
    if pp > 1 and not _option_exists(model_config, spec.blocks_option):
        problems.append(f"parallel.pp={pp}: model family {spec.name!r} registers blocks_option="
                        f"{spec.blocks_option!r}, which is no field of {type(model_config).__name__}; pass "
                        f"ModelSpec(blocks_option=...) the field that counts the plan's blocks (see {DOC}, section 6)")
    return problems
