"""The step runner of a layer-pipelined graph model (GNNPipe; ``parallel/graph/layer_pipeline.py``).

Same contract as the other runners (``build.py``): global metrics under generic names, eval
results as ``eval_loss`` and ``eval_<metric>``. Every rank of a pipeline reads the same chunk
views (it shares its data-parallel rank, hence its graph partition, with its stage peers), so
each counts the step's loss units itself; loss, units and the task's metrics exist on the last
stages only and are reduced over the world, which adds each partition's share once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch import nn

from veomni.config.schema import RunConfig
from veomni.contract import ModelSpec
from veomni.parallel.graph.layer_pipeline import GraphPipeline
from veomni.parallel.mesh import ParallelMeshes
from veomni.tasks.base import EvalBatch, LossOutput, Task
from veomni.train.distributed import all_reduce_values
from veomni.train.runners.step_runner import RunnerBase
from veomni.train.step import add_task_metrics, clip_and_step, count_global_loss_units, step_flops, task_metric_means


class GraphPipelineRunner(RunnerBase):
    whole_model = None

    def __init__(self, pipeline: GraphPipeline, meta_model: nn.Module, cfg: RunConfig, spec: ModelSpec,
                 model_config: Any, task: Task, meshes: ParallelMeshes) -> None:
        super().__init__([pipeline.part], cfg, spec, model_config, task, meshes)
        self.pipeline, self.meta_model = pipeline, meta_model

    def train_step(self, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        global_units = count_global_loss_units(self.task, micro_batches, self.meshes.loss.get_group())
        results = self.pipeline.step(micro_batches, self.dims.loss_size / global_units)
        flops = step_flops(self.spec.cost, self.meta_model, micro_batches) / self.dims.pp
        loss_sum, units, extra = _totals(results)
        names = sorted(extra)
        total_loss, total_units, total_flops, *totals = all_reduce_values(
            [loss_sum, units, flops, *(v for name in names for v in extra[name])])
        metrics = {"loss": total_loss / global_units, "units": int(total_units), "loss_units": int(global_units),
                   "flops": total_flops}
        metrics.update(task_metric_means(names, totals))
        metrics.update(clip_and_step(self.parts, self.optimizer, self.scheduler, self.cfg.train.max_grad_norm,
                                     self.meshes.pp.get_group(), self.guard, metrics["loss"]))
        return metrics

    def evaluate(self, batches: Iterable[EvalBatch]) -> dict[str, float]:
        """A graph's eval batches are its ranks' partitions, one each: every rank has one, so none is
        a repeat (a repeat would be refused: its loss could not be told apart)."""
        items = list(batches)
        if not all(item.counted for item in items):
            raise ValueError("graph eval: a rank's partition ran out before the others'; set train.eval_batches "
                             "to the partitions' batch count")
        loss_sum, units, extra = _totals(self.pipeline.evaluate([item.batch for item in items]))
        samples = sum(item.samples for item in items) if self.dims.pp == 1 or self.pipeline.is_last else 0
        return self.eval_result(loss_sum, units, extra, None, samples=samples)


def _totals(results: list[LossOutput]) -> tuple[float, int, dict[str, list[float]]]:
    """(summed loss, loss units, the task's ``name -> [sum, count]``) of a stage's results. Only
    last stages have results, so the metric names are agreed over the world first (every rank
    must all-reduce the same list); the others add zeros."""
    extra: dict[str, list[float]] = {}
    for result in results:
        add_task_metrics(extra, result.metrics)
    names: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(names, sorted(extra))
    for name in set().union(*names):
        extra.setdefault(name, [0.0, 0])
    return (sum(float(r.loss_sum.detach()) for r in results), sum(r.loss_units for r in results), extra)
