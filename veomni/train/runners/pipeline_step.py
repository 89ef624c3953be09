"""The pipeline-parallel counterpart of ``step.forward_backward``: same loss normalisation, same
metrics, the schedule in place of the per-micro-batch forward/backward loop.

Every rank of a pipeline reads the same micro-batches. Under sequence or context parallelism
(``split``: this rank's ``RowSplit`` among the cp x sp ranks of a row) the loader micro-batches
arrive whole: they are joined into the pipeline's fixed-length rows first and each row is then
cut to this rank's positions (``shard_batch``), so every stage works on this rank's slice of a
row whose ``cu_seqlens`` still describe the whole row, and all rows keep one (padded) length.
The loss units are counted on these local slices and reduced over dp x cp x sp (as without
pipelining) before the schedule runs; the summed loss exists only on last-stage ranks and is
reduced over the whole world. MoE models
join every stage's auxiliary losses to backward and reduce each stage's expert loads through
``moe_stats.PipelineMoEStats``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from veomni.contract.hooks import CostModel, has_moe
from veomni.parallel.pipeline.rows import pack_rows, pad_row
from veomni.parallel.pipeline.schedule import Pipeline
from veomni.parallel.row_split import RowSplit, shard_batch
from veomni.tasks.base import BatchContract, Task
from veomni.train.distributed import all_reduce_values
from veomni.train.moe_stats import PipelineMoEStats
from veomni.train.step import add_task_metrics, count_global_loss_units, step_flops, task_metric_means


def pipeline_rows(micro_batches: list[dict[str, Any]], microbatches: int, length: int,
                  contract: BatchContract, split: RowSplit | None = None) -> list[dict[str, Any]]:
    """``microbatches`` rows of ``length`` elements each: consecutive loader micro-batches joined,
    padded; then, with a ``split`` over several ranks, this rank's positions of each row (all of
    the same length, ``split.padded(length * per) // split.ranks``)."""
    per = len(micro_batches) // microbatches
    rows = [pad_row(pack_rows(micro_batches[i * per:(i + 1) * per], contract), length * per, contract)
            for i in range(microbatches)]
    if split is not None and split.ranks > 1:
        rows = [shard_batch(row, split, contract) for row in rows]
    return rows


def pipeline_forward_backward(pipeline: Pipeline, task: Task, micro_batches: list[dict[str, Any]],
                              loss_group: dist.ProcessGroup, loss_size: int, pp_size: int,
                              row_length: int, whole_model: nn.Module, cost: CostModel | None = None,
                              split: RowSplit | None = None) -> dict[str, Any]:
    """Accumulate the gradients of the step's global unit-mean loss on this rank's stages.

    ``row_length`` is the fixed size of one loader micro-batch (its budget); ``whole_model`` is
    any copy of the full model (meta is fine), which the cost model counts FLOPs on and which
    tells whether the model has MoE layers. ``flops`` is reported when a cost model is given.
    ``split``: this rank's place among the cp x sp ranks that share each row (``micro_batches``
    are then whole loader rows, the same on all of them).
    """
    row_ranks = split.ranks if split is not None else 1
    rows = pipeline_rows(micro_batches, pipeline.microbatches, row_length, task.contract, split)
    # Counted where the loss is computed: on this rank's slices when rows are split.
    global_loss_units = count_global_loss_units(task, rows if row_ranks > 1 else micro_batches, loss_group)
    moe = PipelineMoEStats(pipeline.parts, pipeline.stage_indices, pipeline.microbatches, loss_size) \
        if has_moe(whole_model) else None
    loss_sum = pipeline.step(rows, loss_size / global_loss_units, on_output=moe)
    flops = step_flops(cost, whole_model, micro_batches)
    units = sum(task.contract.row_length(mb) for mb in micro_batches)
    # Over the world: the loss lives on the last stages only (each rank's sum over its slices);
    # units and FLOPs of the whole rows are counted by every stage and every rank of a row.
    copies = pp_size * row_ranks
    # A row-loss task's metrics (pair rewards, say) live on the last stages too; every rank knows their names.
    names = sorted(pipeline.row_task.metric_names) if pipeline.row_task is not None else []
    extra: dict[str, list[float]] = {}
    for row_metrics in pipeline.row_metrics.values():
        add_task_metrics(extra, row_metrics)
    total_loss, total_units, total_flops, *totals = all_reduce_values(
        [loss_sum, units, flops, *(v for name in names for v in extra.get(name, (0.0, 0)))])
    metrics = {"loss": total_loss / global_loss_units, "units": int(round(total_units / copies)),
               "loss_units": int(global_loss_units), "flops": total_flops / copies}
    metrics.update(task_metric_means(names, totals))
    if moe is not None:
        metrics.update(moe.finish(loss_group, pipeline.pp_group))
    return metrics
