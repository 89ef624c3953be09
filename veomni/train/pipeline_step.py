"""The pipeline-parallel counterpart of ``step.forward_backward``: same loss normalisation, same
metrics, the schedule in place of the per-micro-batch forward/backward loop.

Every rank of a pipeline reads the same micro-batches, so each counts the step's loss units
itself (one all-reduce over dp x sp, as without pipelining) before the schedule runs; the
summed loss exists only on last-stage ranks and is reduced over the whole world. MoE models
join every stage's auxiliary losses to backward and reduce each stage's expert loads through
``moe_stats.PipelineMoEStats``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from veomni.parallel.pipeline import Pipeline, pack_rows, pad_row
from veomni.spec.hooks import CostModel, has_moe
from veomni.tasks.base import BatchContract, Task
from veomni.train.distributed import all_reduce_values
from veomni.train.moe_stats import PipelineMoEStats
from veomni.train.step import count_global_loss_units, step_flops


def pipeline_rows(micro_batches: list[dict[str, Any]], microbatches: int, length: int,
                  contract: BatchContract) -> list[dict[str, Any]]:
    """``microbatches`` rows of ``length`` elements each: consecutive loader micro-batches joined, padded."""
    per = len(micro_batches) // microbatches
    return [pad_row(pack_rows(micro_batches[i * per:(i + 1) * per], contract), length * per, contract)
            for i in range(microbatches)]


def pipeline_forward_backward(pipeline: Pipeline, task: Task, micro_batches: list[dict[str, Any]],
                              loss_group: dist.ProcessGroup, loss_size: int, pp_size: int,
                              row_length: int, whole_model: nn.Module, cost: CostModel | None = None
                              ) -> dict[str, Any]:
    """Accumulate the gradients of the step's global unit-mean loss on this rank's stages.

    ``row_length`` is the fixed size of one loader micro-batch (its budget); ``whole_model`` is
    any copy of the full model (meta is fine), which the cost model counts FLOPs on and which
    tells whether the model has MoE layers. ``flops`` is reported when a cost model is given.
    """
    global_loss_units = count_global_loss_units(task, micro_batches, loss_group)
    rows = pipeline_rows(micro_batches, pipeline.microbatches, row_length, task.contract)
    moe = PipelineMoEStats(pipeline.parts, pipeline.stage_indices, pipeline.microbatches, loss_size) \
        if has_moe(whole_model) else None
    loss_sum = pipeline.step(rows, loss_size / global_loss_units, on_output=moe)
    flops = step_flops(cost, whole_model, micro_batches)
    units = sum(task.contract.row_length(mb) for mb in micro_batches)
    # Over the world: the loss lives on the last stages only; units and FLOPs are counted pp times.
    total_loss, total_units, total_flops = all_reduce_values([loss_sum, units, flops])
    metrics = {"loss": total_loss / global_loss_units, "units": int(round(total_units / pp_size)),
               "loss_units": int(global_loss_units), "flops": total_flops / pp_size}
    if moe is not None:
        metrics.update(moe.finish(loss_group, pipeline.pp_group))
    return metrics
