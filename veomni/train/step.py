"""The math of one optimizer step, shared by the trainer and the parity tests.

``forward_backward`` counts the loss tokens of the whole global step first and scales each
micro-batch's summed loss by ``dp_size / global_tokens``: FSDP averages gradients over the
``dp_size`` data-parallel ranks, so the resulting gradient is exactly that of the mean loss
over every loss token of the step, however tokens were split across ranks and micro-batches.
A task's extra metrics (``LossOutput.metrics``, e.g. the terms of a composite loss) ride on the
same final all-reduce and are reported as global sum / global count.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from veomni.train.distributed import all_reduce_values
from veomni.train.tasks import Task


def forward_backward(model: nn.Module, task: Task, micro_batches: list[dict[str, Any]],
                     dp_group: dist.ProcessGroup, dp_size: int) -> dict[str, float]:
    """Accumulate gradients of the global token-mean loss; return global loss/token counts."""
    local_loss_tokens = sum(task.count_tokens(mb) for mb in micro_batches)
    global_loss_tokens = all_reduce_values([local_loss_tokens], group=dp_group)[0]
    if global_loss_tokens == 0:
        raise RuntimeError("no loss tokens on any rank in this step; check the data and its labels")
    scale = dp_size / global_loss_tokens
    loss_sum = 0.0
    extra: dict[str, list[float]] = {}  # name -> [sum, count] of the task's extra metrics
    for mb in micro_batches:
        out = task(model, mb)
        (out.loss_sum * scale).backward()
        loss_sum += float(out.loss_sum.detach())
        for name, (value, count) in out.metrics.items():
            acc = extra.setdefault(name, [0.0, 0])
            acc[0] += float(value)
            acc[1] += count
    flops = sum(model.training_flops(mb["cu_seqlens"].diff().tolist()) for mb in micro_batches)
    tokens = sum(mb["input_ids"].numel() for mb in micro_batches)
    names = sorted(extra)  # every rank runs the same task, so the same names in the same order
    total_loss, total_tokens, total_flops, *totals = all_reduce_values(
        [loss_sum, tokens, flops, *(v for name in names for v in extra[name])], group=dp_group)
    metrics = {"loss": total_loss / global_loss_tokens, "tokens": int(total_tokens),
               "loss_tokens": int(global_loss_tokens), "flops": total_flops}
    for i, name in enumerate(names):
        metrics[name] = totals[2 * i] / max(totals[2 * i + 1], 1)
    return metrics


def clip_and_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                  scheduler: torch.optim.lr_scheduler.LRScheduler | None, max_grad_norm: float) -> dict[str, float]:
    """Clip by the global gradient norm (0 = report only), step, zero the gradients."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf, foreach=True)
    if hasattr(grad_norm, "full_tensor"):  # DTensor under FSDP: the norm is already global
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lr = optimizer.param_groups[0]["lr"]
    if scheduler is not None:
        scheduler.step()
    return {"grad_norm": float(grad_norm), "lr": lr}
