"""The objective seat: a recipe's ``train.objective`` picks what the run optimises.

A model family owns its task (``ModelSpec.task``: next-token cross entropy, flow matching, ...).
An *objective* takes that task and returns the task the run trains with. The default, ``sft``,
returns the family's task itself, unwrapped: such a run is the run it was before objectives
existed, operation for operation. Other objectives (preference optimisation, later online RL)
wrap it: they may add per-batch fields before the loss, change the loss, and own frozen models.

Frozen models come through one typed seat, ``Objective.attach``: once the policy is built the
trainer hands every objective a ``FrozenModels``: the policy, a builder of a second copy of the
policy at its starting weights (built, initialised and sharded by the same parallel recipe, with
no gradients and no optimizer state: nothing the runner steps or checkpoints), whether the policy
carries LoRA adapters (then its base with the adapters switched off *is* the starting model, and
no copy is needed), the process group of the ranks that hold pieces of one packed row (sums
along a row split by sequence or context parallelism are completed over it) and, under
``parallel.pp``, the pipeline (``veomni.tasks.staged.StagedModel``: this rank's stages and a
forward-only walk of rows through them). The trainer knows nothing else about any objective.

Objectives register by name like model families and dataset kinds; a plug-in package listed in
``model.plugins`` may call ``register_objective``.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from veomni.config.schema import RunConfig
from veomni.tasks.base import Task
from veomni.tasks.staged import StagedModel


@dataclass(frozen=True)
class ObjectiveRequest:
    """What an objective builds from: the run's config and the family's own task."""

    cfg: RunConfig
    task: Task


@dataclass(frozen=True)
class FrozenModels:
    """What the engine gives an objective once the policy is built (``Objective.attach``)."""

    policy: nn.Module | None
    """The model being trained (parallelised; the whole model on each rank); None under a pipeline."""
    frozen_copy: Callable[[], nn.Module]
    """Builds another copy of the policy at its starting weights (the seeded init and the recipe's
    pretrained folders), sharded by the same parallel recipe, every parameter frozen, in eval mode;
    under a pipeline an ``nn.ModuleList`` of this rank's stages of it, cut like ``pipeline.parts``."""
    adapters: bool
    """The policy carries LoRA adapters: its base with them switched off is the starting model."""
    row_group: dist.ProcessGroup | None
    """The ranks holding pieces of one packed row (context x sequence parallel); None when each
    rank holds whole rows."""
    pipeline: StagedModel | None = None
    """The policy's pipeline under ``parallel.pp > 1``, else None."""


@dataclass(frozen=True)
class FeedRequest:
    """What an objective that makes its own batches builds its feed from (``Objective.feed``)."""

    feed: Any
    """The run's data feed: ``next_step()`` gives this rank's micro-batches of the data kind,
    ``step_metrics()`` its metrics."""
    tokenizer: Any
    device: torch.device
    lockstep_group: dist.ProcessGroup | None
    """The ranks that must run the same number of forward passes (FSDP gathers); None: one process."""
    metrics_group: dist.ProcessGroup | None
    """The data-parallel ranks over which per-rank metrics are summed; None: one process."""
    seed: int
    dp_rank: int
    start_step: int
    """The step the run starts at (after a resume)."""
    model_config: Any = None
    """The family's model config (a VLM's gives the ``media_layout()`` its media prompts need)."""


@dataclass
class Objective:
    name: str
    task: Task
    """The task the run trains and evaluates with."""
    attach: Callable[[FrozenModels], None] | None = None
    """Called once after the policy is built; None: the objective needs no model of its own."""
    feed: Callable[[FeedRequest], Any] | None = None
    """Builds the feed the run trains from (``next_step()``, ``step_metrics()``) out of the data
    kind's (online RL: rollouts from prompts), once attached; None: the data kind's batches."""
    evaluates: bool = True
    """Whether the held-out data are scored with the task's loss (false: the objective's data are
    not what its task takes, e.g. prompts)."""


ObjectiveFactory = Callable[[ObjectiveRequest], Objective]


@dataclass(frozen=True)
class ObjectiveEntry:
    build: ObjectiveFactory
    pipelines: bool = False
    """Whether it runs under ``parallel.pp`` (the launcher refuses the run otherwise)."""
    pipelines_split_rows: bool = False
    """Whether it also runs under ``parallel.pp`` with rows split by ``parallel.sp`` / ``parallel.cp``."""
    frozen_copies: int | Callable[[RunConfig], int] = 0
    """Full frozen copies of the policy it holds when the run has no LoRA (or the run's settings'
    count of them, e.g. a reference held only for a KL penalty)."""
    data_kinds: tuple[str, ...] = ()
    """The dataset kinds whose batches it can read (empty: any)."""
    checks: Callable[[RunConfig], list[str]] | None = None
    """The launcher's further checks of the run's settings for it (problems; empty: none)."""
    rollouts: bool = False
    """Whether it generates rollouts with the ``rl`` settings (the dry-run plan lists that phase)."""


_OBJECTIVES: dict[str, ObjectiveEntry] = {}


def register_objective(name: str, build: ObjectiveFactory, pipelines: bool = False,
                       frozen_copies: int | Callable[[RunConfig], int] = 0,
                       data_kinds: tuple[str, ...] = (), pipelines_split_rows: bool = False,
                       checks: Callable[[RunConfig], list[str]] | None = None, rollouts: bool = False) -> None:
    """Make ``train.objective: <name>`` build its objective with ``build``."""
    entry = ObjectiveEntry(build, pipelines, pipelines_split_rows, frozen_copies, data_kinds, checks, rollouts)
    if _OBJECTIVES.get(name, entry) != entry:
        raise ValueError(f"objective {name!r} is already registered")
    _OBJECTIVES[name] = entry


def objective_entry(name: str) -> ObjectiveEntry:
    if name not in _OBJECTIVES:
        near = difflib.get_close_matches(name, _OBJECTIVES, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"train.objective: unknown objective {name!r}{hint} (registered: {sorted(_OBJECTIVES)}; "
                         "a plug-in package in model.plugins may register more)")
    return _OBJECTIVES[name]


def build_objective(request: ObjectiveRequest) -> Objective:
    return objective_entry(request.cfg.train.objective).build(request)


def objective_problems(cfg: RunConfig, data_kind: str, encoders_outside_stages: bool = False) -> list[str]:
    """The launcher's checks of ``train.objective`` (after the plug-ins are imported); ``data_kind``:
    the dataset kind the run reads; ``encoders_outside_stages``: whether a pipeline runs the model's
    media encoders apart from its stages (``parallel.encoder_colocate`` on a model with encoders)."""
    try:
        entry = objective_entry(cfg.train.objective)
    except ValueError as error:
        return [str(error)]
    if entry.data_kinds and data_kind not in entry.data_kinds:
        return [f"train.objective={cfg.train.objective} reads {' or '.join(entry.data_kinds)} data, not the "
                f"{data_kind} kind: set data.kind (docs/post_training.md, the data format)"]
    parallel = cfg.parallel
    if parallel.pp > 1 and not entry.pipelines:
        return [f"train.objective={cfg.train.objective} does not run under a pipeline yet (parallel.pp="
                f"{parallel.pp}): use parallel.pp 1 (FSDP, sequence, context and expert parallelism all apply)"]
    if parallel.pp > 1 and parallel.sp * parallel.cp > 1 and not entry.pipelines_split_rows:
        return [f"train.objective={cfg.train.objective} runs under a pipeline with whole rows only (parallel.pp="
                f"{parallel.pp} with sp={parallel.sp}, cp={parallel.cp}): set parallel.sp and parallel.cp to 1, or "
                "parallel.pp to 1 (sequence and context parallelism then apply)"]
    if parallel.pp > 1 and encoders_outside_stages and frozen_copies(cfg) > 0:
        return [f"train.objective={cfg.train.objective} keeps a frozen copy of the model, which a pipeline cannot "
                f"cut with the encoders outside its stages (parallel.pp={parallel.pp}, parallel.encoder_colocate "
                "true): train with LoRA (lora.rank > 0: the reference is the base with its adapters off, no copy) "
                "or set parallel.encoder_colocate false"]
    return entry.checks(cfg) if entry.checks is not None else []


def reference_copies(cfg: RunConfig) -> int:
    """Frozen copies of the starting model the run's objective holds with its settings (under LoRA
    the base with its adapters off serves as each)."""
    copies = objective_entry(cfg.train.objective).frozen_copies
    return copies(cfg) if callable(copies) else copies


def frozen_copies(cfg: RunConfig) -> int:
    """Full frozen copies of the model the run's objective holds (0 under LoRA: the base serves)."""
    return 0 if cfg.lora.rank > 0 else reference_copies(cfg)


def _supervised(request: ObjectiveRequest) -> Objective:
    return Objective("sft", request.task)


register_objective("sft", _supervised, pipelines=True, pipelines_split_rows=True)
