"""The pipeline-parallel counterpart of ``step.forward_backward``: same loss normalisation, same
metrics, the schedule in place of the per-micro-batch forward/backward loop.

Every rank of a pipeline reads the same micro-batches, so each counts the step's loss tokens
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
from veomni.train.distributed import all_reduce_values
from veomni.train.moe_stats import PipelineMoEStats
from veomni.train.step import count_global_loss_tokens, micro_batch_flops
from veomni.train.tasks import Task


def pipeline_rows(micro_batches: list[dict[str, Any]], microbatches: int, tokens: int) -> list[dict[str, Any]]:
    """``microbatches`` rows of ``tokens`` each: consecutive loader micro-batches joined, padded."""
    per = len(micro_batches) // microbatches
    return [pad_row(pack_rows(micro_batches[i * per:(i + 1) * per]), tokens * per) for i in range(microbatches)]


def pipeline_forward_backward(pipeline: Pipeline, task: Task, micro_batches: list[dict[str, Any]],
                              loss_group: dist.ProcessGroup, loss_size: int, pp_size: int,
                              row_tokens: int, flops_model: nn.Module) -> dict[str, Any]:
    """Accumulate the gradients of the step's global token-mean loss on this rank's stages.

    ``row_tokens`` is the fixed size of one loader micro-batch (its token budget); ``flops_model``
    is any copy of the full model (meta is fine) that counts FLOPs and tells whether it has
    MoE layers.
    """
    global_loss_tokens = count_global_loss_tokens(task, micro_batches, loss_group)
    rows = pipeline_rows(micro_batches, pipeline.microbatches, row_tokens)
    has_moe = callable(getattr(flops_model, "moe_layers", None)) and bool(flops_model.moe_layers())
    moe = PipelineMoEStats(pipeline.parts, pipeline.stage_indices, pipeline.microbatches, loss_size) \
        if has_moe else None
    loss_sum = pipeline.step(rows, loss_size / global_loss_tokens, on_output=moe)
    flops = sum(micro_batch_flops(flops_model, mb) for mb in micro_batches)
    tokens = sum(mb["input_ids"].numel() for mb in micro_batches)
    # Over the world: the loss lives on the last stages only; tokens and FLOPs are counted pp times.
    total_loss, total_tokens, total_flops = all_reduce_values([loss_sum, tokens, flops])
    metrics = {"loss": total_loss / global_loss_tokens, "tokens": int(round(total_tokens / pp_size)),
               "loss_tokens": int(global_loss_tokens), "flops": total_flops / pp_size}
    if moe is not None:
        metrics.update(moe.finish(loss_group, pipeline.pp_group))
    return metrics
