"""Step runners: how one optimizer step and one evaluation run, chosen once at set-up.

``PlainRunner`` runs each micro-batch forward and backward on the (FSDP/EP/SP-parallelised)
model; ``PipelineRunner`` hands a step's micro-batches to a pipeline schedule. Both own the
optimizer and LR schedule of the modules they hold (``parts``), return the same global metrics
(generic names: ``units``, ``loss_units``, ``flops``; the trainer names them after the task's
unit) and the same eval results, so the trainer's loop has no branch on the parallel layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from veomni.config.schema import RunConfig
from veomni.parallel.apply import parallelize
from veomni.parallel.materialize import build_sharded
from veomni.parallel.mesh import ParallelDims, ParallelMeshes
from veomni.parallel.pipeline import Pipeline, build_pipeline, empty_row
from veomni.spec import ModelSpec
from veomni.tasks.base import Task
from veomni.train.distributed import all_reduce_values
from veomni.train.optim import build_optimizer, build_scheduler
from veomni.train.pipeline_step import pipeline_forward_backward, pipeline_rows
from veomni.train.step import add_task_metrics, clip_and_step, forward_backward, task_metric_means


class StepRunner(Protocol):
    parts: list[nn.Module]
    """The modules this rank holds (the model, or its pipeline stages): checkpointed and stepped."""
    whole_model: nn.Module | None
    """The model when every rank runs all of it (for decoding a sample), else None."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    def train_step(self, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        """Forward, backward, clip and step over this rank's micro-batches; global metrics."""
        ...

    def evaluate(self, batches: Iterable[dict[str, Any]]) -> dict[str, float]:
        """``eval_loss`` and ``eval_<name>`` per task metric over the batches of every rank
        ({} when no rank had a loss unit)."""
        ...


class _RunnerBase:
    def __init__(self, parts: list[nn.Module], cfg: RunConfig, spec: ModelSpec, model_config: Any, task: Task,
                 meshes: ParallelMeshes) -> None:
        self.parts, self.cfg, self.spec, self.task, self.meshes = parts, cfg, spec, task, meshes
        self.dims: ParallelDims = meshes.dims
        self.optimizer = build_optimizer(parts, cfg.train, spec.param_rules(model_config))
        self.scheduler = build_scheduler(self.optimizer, cfg.train)

    def _eval_result(self, loss_sum: float, units: float, extra: dict[str, list[float]],
                     group: dist.ProcessGroup | None, units_divisor: int = 1) -> dict[str, float]:
        names = sorted(extra)
        total_loss, total_units, *totals = all_reduce_values(
            [loss_sum, units, *(v for name in names for v in extra[name])], group=group)
        total_units /= units_divisor
        if not total_units:
            return {}
        result = {"eval_loss": total_loss / total_units}
        result.update({f"eval_{k}": v for k, v in task_metric_means(names, totals).items()})
        return result


class PlainRunner(_RunnerBase):
    def __init__(self, model: nn.Module, cfg: RunConfig, spec: ModelSpec, model_config: Any, task: Task,
                 meshes: ParallelMeshes) -> None:
        super().__init__([model], cfg, spec, model_config, task, meshes)
        self.model = self.whole_model = model

    def train_step(self, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        metrics = forward_backward(self.model, self.task, micro_batches, self.meshes.loss.get_group(),
                                   self.dims.loss_size, self.dims.sp, self.spec.cost)
        metrics.update(clip_and_step(self.parts, self.optimizer, self.scheduler, self.cfg.train.max_grad_norm))
        return metrics

    def evaluate(self, batches: Iterable[dict[str, Any]]) -> dict[str, float]:
        loss_sum, units = 0.0, 0
        extra: dict[str, list[float]] = {}
        for batch in batches:
            out = self.task(self.model, batch)
            loss_sum += float(out.loss_sum)
            units += out.loss_units
            add_task_metrics(extra, out.metrics)
        return self._eval_result(loss_sum, units, extra, self.meshes.loss.get_group())


class PipelineRunner(_RunnerBase):
    """Every rank of a pipeline reads the same micro-batches; ``whole_model`` is a meta copy of
    the full model, for the cost model only."""

    whole_model = None

    def __init__(self, pipeline: Pipeline, meta_model: nn.Module, cfg: RunConfig, spec: ModelSpec,
                 model_config: Any, task: Task, meshes: ParallelMeshes) -> None:
        super().__init__(pipeline.parts, cfg, spec, model_config, task, meshes)
        self.pipeline, self.meta_model = pipeline, meta_model

    def train_step(self, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        metrics = pipeline_forward_backward(self.pipeline, self.task, micro_batches, self.meshes.loss.get_group(),
                                            self.dims.loss_size, self.dims.pp, self.cfg.data.tokens_per_micro_batch,
                                            self.meta_model, self.spec.cost)
        metrics.update(clip_and_step(self.parts, self.optimizer, self.scheduler, self.cfg.train.max_grad_norm,
                                     self.meshes.pp.get_group()))
        return metrics

    def evaluate(self, batches: Iterable[dict[str, Any]]) -> dict[str, float]:
        """Eval batches in groups of one step's micro-batches; a short last group is filled with
        rows without loss units (the schedule always runs its full micro-batch count). The loss
        sums live on the last stages, so they are reduced over the world, and the units (counted
        on every stage) once per pipeline."""
        size, loss_sum, units = self.cfg.train.grad_accum, 0.0, 0
        batches = list(batches)
        contract = self.task.contract
        for start in range(0, len(batches), size):
            group = batches[start:start + size]
            units += sum(self.task.count_loss_units(b) for b in group)
            group += [empty_row(group[0], contract)] * (size - len(group))
            loss_sum += self.pipeline.evaluate(pipeline_rows(group, self.pipeline.microbatches,
                                                             self.cfg.data.tokens_per_micro_batch, contract))
        return self._eval_result(loss_sum, units, {}, None, units_divisor=self.dims.pp)


def build_runner(cfg: RunConfig, spec: ModelSpec, model_config: Any, task: Task, meshes: ParallelMeshes,
                 device: torch.device, initialise: Callable[[nn.Module], None]) -> StepRunner:
    """The model built, initialised (``initialise`` runs on rank 0's full CPU copy), parallelised
    by the one recipe and wrapped in the runner its layout needs."""
    build = functools.partial(spec.instantiate, model_config)
    recipe = functools.partial(parallelize, cfg=cfg.parallel, meshes=meshes, device_type=device.type)
    if meshes.dims.pp > 1:
        pipeline = build_pipeline(build, initialise, recipe, cfg.parallel, cfg.train.grad_accum, meshes.pp,
                                  device, task)
        with torch.device("meta"):
            meta_model = build()
        return PipelineRunner(pipeline, meta_model, cfg, spec, model_config, task, meshes)
    model = build_sharded(build=build, initialise=initialise, parallelize=recipe, device=device)
    return PlainRunner(model, cfg, spec, model_config, task, meshes)
