"""Step runners: how one optimizer step and one evaluation run, chosen once at set-up.

``PlainRunner`` runs each micro-batch forward and backward on the (FSDP/EP/SP-parallelised)
model; ``PipelineRunner`` hands a step's micro-batches to a pipeline schedule;
``GraphPipelineRunner`` (``graph_pipeline.py``) runs a graph model's chunks through its layer
pipeline, chosen for models whose plan names message-passing modules. All own the optimizer and
LR schedule of the modules they hold (``parts``), return the same global metrics
(generic names: ``units``, ``loss_units``, ``flops``; the trainer names them after the task's
unit) and the same eval results, so the trainer's loop has no branch on the parallel layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from veomni.adapters.lora import adapted_model, base_dtype
from veomni.config.schema import RunConfig
from veomni.contract import ModelSpec
from veomni.contract.plan import flatten_plan
from veomni.errors import BadInput
from veomni.parallel.apply import PIPELINE_HOOKS, parallelize
from veomni.parallel.graph.layer_pipeline import GraphPipeline
from veomni.parallel.materialize import build_sharded
from veomni.parallel.mesh import ParallelMeshes
from veomni.parallel.pipeline.rows import empty_row
from veomni.parallel.pipeline.schedule import Pipeline
from veomni.parallel.pipeline.stages import build_pipeline, build_stage_parts
from veomni.parallel.pipeline.tied import aliases, tied_names
from veomni.tasks.base import EvalBatch, Task
from veomni.train.runners.graph_pipeline import GraphPipelineRunner
from veomni.train.runners.pipeline_step import pipeline_forward_backward, pipeline_rows
from veomni.train.runners.step_runner import RunnerBase, StepRunner
from veomni.train.step import add_task_metrics, clip_and_step, forward_backward


class PlainRunner(RunnerBase):
    def __init__(self, model: nn.Module, cfg: RunConfig, spec: ModelSpec, model_config: Any, task: Task,
                 meshes: ParallelMeshes) -> None:
        super().__init__([model], cfg, spec, model_config, task, meshes)
        self.model = self.whole_model = model

    def train_step(self, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        metrics = forward_backward(self.model, self.task, micro_batches, self.meshes.loss.get_group(),
                                   self.dims.loss_size, self.dims.row_ranks, self.spec.cost)
        metrics.update(clip_and_step(self.parts, self.optimizer, self.scheduler, self.cfg.train.max_grad_norm,
                                     guard=self.guard, loss=metrics["loss"]))
        return metrics

    def evaluate(self, batches: Iterable[EvalBatch]) -> dict[str, float]:
        loss_sum, units, samples = 0.0, 0, 0
        extra: dict[str, list[float]] = {}
        for item in batches:
            out = self.task(self.model, item.batch)
            if item.counted:
                loss_sum += float(out.loss_sum)
                units += out.loss_units
                samples += item.samples
                add_task_metrics(extra, out.metrics)
        return self.eval_result(loss_sum, units, extra, self.meshes.loss.get_group(), samples=samples,
                                samples_divisor=self.dims.row_ranks)


class PipelineRunner(RunnerBase):
    """Every rank of a pipeline reads the same micro-batches; ``whole_model`` is a meta copy of
    the full model, for the cost model only. Under sequence / context parallelism it gets whole
    loader rows and cuts each pipeline row to this rank's positions (``pipeline_rows``)."""

    whole_model = None
    shards_rows = True

    def __init__(self, pipeline: Pipeline, meta_model: nn.Module, cfg: RunConfig, spec: ModelSpec,
                 model_config: Any, task: Task, meshes: ParallelMeshes) -> None:
        super().__init__(pipeline.modules, cfg, spec, model_config, task, meshes)
        self.pipeline, self.meta_model = pipeline, meta_model
        self.tied = aliases(tied_names(meta_model))

    def train_step(self, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        metrics = pipeline_forward_backward(self.pipeline, self.task, micro_batches, self.meshes.loss.get_group(),
                                            self.dims.loss_size, self.dims.pp, self.cfg.data.tokens_per_micro_batch,
                                            self.meta_model, self.spec.cost, self.meshes.row_split)
        metrics.update(clip_and_step(self.parts, self.optimizer, self.scheduler, self.cfg.train.max_grad_norm,
                                     self.meshes.pp.get_group(), self.guard, metrics["loss"],
                                     self.pipeline.uncounted))
        return metrics

    def evaluate(self, batches: Iterable[EvalBatch]) -> dict[str, float]:
        """Eval batches in groups of one step's micro-batches; a short last group is filled with
        rows without loss units (the schedule always runs its full micro-batch count), and so is an
        uncounted batch (a repeat that keeps a rank whose share ended in step). The loss
        sums and the task's metrics (``output_metrics``) live on the last stages, so they are
        reduced over the world, and the units (counted on the whole rows by every stage and every
        cp x sp rank) once per pipeline and row."""
        size, loss_sum, units = self.cfg.train.grad_accum, 0.0, 0
        extra: dict[str, list[float]] = {}
        contract = self.task.contract
        items = list(batches)
        samples = sum(item.samples for item in items if item.counted)
        batches = [item.batch if item.counted else empty_row(item.batch, contract) for item in items]
        for start in range(0, len(batches), size):
            group = batches[start:start + size]
            units += sum(self.task.count_loss_units(b) for b in group)
            group += [empty_row(group[0], contract)] * (size - len(group))
            loss, row_metrics = self.pipeline.evaluate(pipeline_rows(group, self.pipeline.microbatches,
                                                                     self.cfg.data.tokens_per_micro_batch, contract,
                                                                     self.meshes.row_split))
            loss_sum += loss
            for metrics in row_metrics:
                add_task_metrics(extra, metrics)
        # Only last stages hold task metrics: every rank must reduce the same names.
        names: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(names, sorted(extra))
        for name in set().union(*names):
            extra.setdefault(name, [0.0, 0])
        counted_by = self.dims.pp * self.dims.row_ranks  # every stage and cp x sp rank counts a whole row
        return self.eval_result(loss_sum, units, extra, None, units_divisor=counted_by, samples=samples,
                                samples_divisor=counted_by)


def model_recipe(cfg: RunConfig, spec: ModelSpec, model_config: Any, meshes: ParallelMeshes,
                 device: torch.device) -> tuple[Callable[[], nn.Module], Callable[[nn.Module], nn.Module]]:
    """(build the plain model, with the run's adapters; apply the run's parallel recipe to it)."""
    build = functools.partial(adapted_model, functools.partial(spec.instantiate, model_config), cfg.lora)
    recipe = functools.partial(parallelize, cfg=cfg.parallel, meshes=meshes, device_type=device.type,
                               row_tokens=cfg.data.tokens_per_micro_batch,
                               frozen_dtype=base_dtype(cfg.lora, device.type, cfg.parallel.mixed_precision),
                               graph_hops=len(cfg.data.graph_fanouts))
    return build, recipe


def build_frozen_copy(cfg: RunConfig, spec: ModelSpec, model_config: Any, meshes: ParallelMeshes,
                      device: torch.device, initialise: Callable[[nn.Module], None]) -> nn.Module:
    """A second copy of the model (an objective's reference policy), built and sharded like the
    trained one, with every parameter frozen and in eval mode: no runner steps or saves it. Under
    a pipeline, an ``nn.ModuleList`` of this rank's stages of it, cut as the trained model's."""
    build, recipe = model_recipe(cfg, spec, model_config, meshes, device)
    if meshes.dims.pp > 1:
        parts, indices = build_stage_parts(build, initialise, recipe, cfg.parallel, cfg.train.grad_accum,
                                           meshes.pp, device, hooks=PIPELINE_HOOKS)
        if len(parts) != len(indices):
            raise BadInput("a frozen copy of a pipelined model whose encoders run outside the stages "
                           "(parallel.encoder_colocate) is not supported: set parallel.encoder_colocate false, or "
                           "train with LoRA (lora.rank > 0: the reference is the base, no copy)")
        model: nn.Module = nn.ModuleList(parts)
    else:
        model = build_sharded(build=build, initialise=initialise, parallelize=recipe, device=device)
    model.requires_grad_(False)
    return model.eval()


def build_runner(cfg: RunConfig, spec: ModelSpec, model_config: Any, task: Task, meshes: ParallelMeshes,
                 device: torch.device, initialise: Callable[[nn.Module], None]) -> StepRunner:
    """The model built, initialised (``initialise`` runs on rank 0's full CPU copy), parallelised
    by the one recipe and wrapped in the runner its layout needs."""
    build, recipe = model_recipe(cfg, spec, model_config, meshes, device)
    if meshes.dims.pp > 1:
        with torch.device("meta"):
            meta_model = build()
        if flatten_plan(meta_model.parallel_plan()).message_passing:
            parts, stages = build_stage_parts(build, initialise, recipe, cfg.parallel, cfg.train.grad_accum,
                                              meshes.pp, device, probe=meta_model, hooks=PIPELINE_HOOKS)
            graph = GraphPipeline(parts[0], stages[0], meshes.dims.pp, cfg.parallel.pp_schedule, meshes.pp.get_group(),
                                  device, task)
            return GraphPipelineRunner(graph, meta_model, cfg, spec, model_config, task, meshes)
        pipeline = build_pipeline(build, initialise, recipe, cfg.parallel, cfg.train.grad_accum, meshes.pp,
                                  device, task, meshes, meta_model, hooks=PIPELINE_HOOKS)
        return PipelineRunner(pipeline, meta_model, cfg, spec, model_config, task, meshes)
    model = build_sharded(build=build, initialise=initialise, parallelize=recipe, device=device)
    return PlainRunner(model, cfg, spec, model_config, task, meshes)
