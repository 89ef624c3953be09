"""What every step runner provides (``StepRunner``) and the part they share (``RunnerBase``:
the optimizer and LR schedule of the modules a rank holds, and the eval reduction)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from veomni.config.schema import RunConfig
from veomni.contract import ModelSpec
from veomni.optim import build_optimizer, build_scheduler
from veomni.parallel.mesh import ParallelDims, ParallelMeshes
from veomni.tasks.base import EvalBatch, Task
from veomni.tasks.staged import StagedModel
from veomni.train.distributed import all_reduce_values
from veomni.train.fault.guard import StepGuard
from veomni.train.step import task_metric_means


class StepRunner(Protocol):
    parts: list[nn.Module]
    """The modules this rank holds (the model, or its pipeline stages): checkpointed and stepped."""
    whole_model: nn.Module | None
    """The model when every rank runs all of it (for decoding a sample), else None."""
    pipeline: StagedModel | None
    """The stages and their forward-only walk under ``parallel.pp`` (an objective's reference runs
    through it), else None."""
    shards_rows: bool
    """True when the runner cuts rows to this rank's cp x sp positions itself (a pipeline joins a
    step's loader rows first): the trainer then hands it whole rows."""
    tied: dict[str, list[str]]
    """Each tied parameter name -> its other names, for a checkpoint load that reads a name
    through its twin (``pipeline_tied.aliases``; a pipeline holds one copy per stage)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    guard: StepGuard
    """Skips steps with a non-finite (or spiking) loss or gradient norm (``guard.py``)."""

    def train_step(self, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        """Forward, backward, clip and step over this rank's micro-batches; global metrics (with
        ``skipped``: why, when the guard rejected the step)."""
        ...

    def evaluate(self, batches: Iterable[EvalBatch]) -> dict[str, float]:
        """``eval_loss``, ``eval_<name>`` per task metric and ``eval_samples`` over the counted
        batches of every rank ({} when no rank had a loss unit); uncounted ones only run."""
        ...


class RunnerBase:
    shards_rows = False
    pipeline: StagedModel | None = None

    def __init__(self, parts: list[nn.Module], cfg: RunConfig, spec: ModelSpec, model_config: Any, task: Task,
                 meshes: ParallelMeshes) -> None:
        self.parts, self.cfg, self.spec, self.task, self.meshes = parts, cfg, spec, task, meshes
        self.dims: ParallelDims = meshes.dims
        self.optimizer = build_optimizer(parts, cfg.train, spec.param_rules(model_config), cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.guard = StepGuard(cfg.train.loss_spike_factor, cfg.train.loss_spike_window)
        self.tied: dict[str, list[str]] = {}

    def eval_result(self, loss_sum: float, units: float, extra: dict[str, list[float]],
                    group: dist.ProcessGroup | None, units_divisor: int = 1, samples: int = 0,
                    samples_divisor: int = 1) -> dict[str, float]:
        """The global eval metrics. ``*_divisor``: how many ranks of ``group`` counted each unit /
        sample (a row's samples are counted on every rank that holds a piece of it)."""
        names = sorted(extra)
        total_loss, total_units, total_samples, *totals = all_reduce_values(
            [loss_sum, units, samples, *(v for name in names for v in extra[name])], group=group)
        total_units /= units_divisor
        if not total_units:
            return {}
        # how much of the held-out set the loss covers, in samples and in the task's loss units: the
        # summary states it
        result = {"eval_loss": total_loss / total_units,
                  f"eval_loss_{self.task.contract.loss_units_name}": round(total_units),
                  "eval_samples": round(total_samples / samples_divisor)}
        result.update({f"eval_{k}": v for k, v in task_metric_means(names, totals).items()})
        return result


