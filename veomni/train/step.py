"""The math of one optimizer step, shared by the step runners and the parity tests.

``forward_backward`` counts the loss units (the task's: tokens, latent patches, nodes) of the
whole global step first and scales each micro-batch's summed loss by ``loss_size /
global_units``: FSDP averages gradients over the ``loss_size`` ranks that hold the step's units
(data-parallel x sequence-parallel), so the resulting gradient is exactly that of the mean loss
over every loss unit of the step, however units were split across ranks, sequence slices and
micro-batches.

MoE models add their auxiliary losses (load balance, z-loss) per micro-batch. Each rank's value
is already its share of the global micro-batch's loss (the layers normalise by globally reduced
counts), so it is weighted ``loss_size / micro_batches``: the mean over micro-batches of the
global auxiliary loss. After backward the step's expert loads are reduced once and the router
biases updated (``moe_stats.py``).
A task's extra metrics (``LossOutput.metrics``, e.g. the terms of a composite loss) ride on the
same final all-reduce and are reported as global sum / global count.

Metrics use generic names (``units``: row elements processed, ``loss_units``, ``flops``); the
trainer names them after the task's unit when it reports them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from veomni.contract.hooks import CostModel
from veomni.tasks.base import Task
from veomni.train.distributed import all_reduce_values
from veomni.train.fault.guard import StepGuard
from veomni.train.moe_stats import MoEStepStats


def forward_backward(model: nn.Module, task: Task, micro_batches: list[dict[str, Any]],
                     loss_group: dist.ProcessGroup, loss_size: int, row_ranks: int = 1,
                     cost: CostModel | None = None) -> dict[str, Any]:
    """Accumulate gradients of the global unit-mean loss; return global loss/unit counts.

    With sequence or context parallelism each micro-batch is this rank's part of a packed row
    that still describes the whole row (``cu_seqlens``), so model FLOPs are shared by the
    ``row_ranks`` (cp x sp) ranks. ``flops`` is reported when a cost model is given (0 otherwise).
    """
    global_loss_units = count_global_loss_units(task, micro_batches, loss_group)
    scale = loss_size / global_loss_units
    loss_sum = 0.0
    moe = MoEStepStats.for_model(model, len(micro_batches))
    extra: dict[str, list[float]] = {}  # name -> [sum, count] of the task's extra metrics
    for mb in micro_batches:
        out = task(model, mb)
        loss = out.loss_sum * scale
        aux = moe.aux_loss() if moe is not None else None
        if aux is not None:
            loss = loss + aux * (loss_size / len(micro_batches))
        loss.backward()
        if moe is not None:
            moe.record()
        loss_sum += float(out.loss_sum.detach())
        add_task_metrics(extra, out.metrics)
    flops = step_flops(cost, model, micro_batches) / row_ranks
    units = sum(task.contract.row_length(mb) for mb in micro_batches)
    names = sorted(extra)  # every rank runs the same task, so the same names in the same order
    total_loss, total_units, total_flops, *totals = all_reduce_values(
        [loss_sum, units, flops, *(v for name in names for v in extra[name])], group=loss_group)
    metrics = {"loss": total_loss / global_loss_units, "units": int(total_units),
               "loss_units": int(global_loss_units), "flops": total_flops}
    metrics.update(task_metric_means(names, totals))
    if moe is not None:
        metrics.update(moe.finish(loss_group))
    return metrics


def add_task_metrics(acc: dict[str, list[float]], metrics: dict[str, tuple[torch.Tensor, int]]) -> None:
    """Add one micro-batch's ``LossOutput.metrics`` to running ``name -> [sum, count]`` pairs."""
    for name, (value, count) in metrics.items():
        pair = acc.setdefault(name, [0.0, 0])
        pair[0] += float(value)
        pair[1] += count


def task_metric_means(names: list[str], totals: Sequence[float]) -> dict[str, float]:
    """Global means from the reduced ``[sum, count]`` pairs of ``names``, in order."""
    return {name: totals[2 * i] / max(totals[2 * i + 1], 1) for i, name in enumerate(names)}


def count_global_loss_units(task: Task, micro_batches: list[dict[str, Any]],
                            loss_group: dist.ProcessGroup) -> int:
    """The step's loss units over every rank of ``loss_group``: the loss normalisation, known
    before any backward."""
    local = sum(task.count_loss_units(mb) for mb in micro_batches)
    total = all_reduce_values([local], group=loss_group)[0]
    if total == 0:
        raise RuntimeError("no loss units on any rank in this step; check the data and its labels")
    return total


def step_flops(cost: CostModel | None, model: nn.Module, micro_batches: list[dict[str, Any]]) -> float:
    """Forward + backward model FLOPs of the micro-batches by the family's cost model."""
    return sum(cost.batch_flops(model, mb) for mb in micro_batches) if cost is not None else 0.0


def clip_and_step(model: nn.Module | Sequence[nn.Module], optimizer: torch.optim.Optimizer,
                  scheduler: torch.optim.lr_scheduler.LRScheduler | None, max_grad_norm: float,
                  pp_group: dist.ProcessGroup | None = None, guard: StepGuard | None = None,
                  loss: float = 0.0, uncounted: Sequence[nn.Parameter] = ()) -> dict[str, Any]:
    """Clip by the global gradient norm (0 = report only), step, zero the gradients. ``model``
    may be this rank's pipeline stage modules, with ``pp_group`` joining the stages' norms. With a
    ``guard``, a step it rejects (by the step's global ``loss`` and the norm) only zeroes the
    gradients, and the metrics say why under ``skipped``. ``uncounted``: parameters clipped but
    left out of the norm (a pipeline's second copy of a tied parameter, ``Pipeline.uncounted``)."""
    parts = [model] if isinstance(model, nn.Module) else list(model)
    grad_norm = float(clip_grad_norm([p for part in parts for p in part.parameters()], max_grad_norm or math.inf,
                                     pp_group, uncounted))
    lr = optimizer.param_groups[0]["lr"]
    skipped = guard.verdict(loss, grad_norm) if guard is not None else ""
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None and not skipped:
        scheduler.step()
    return {"grad_norm": grad_norm, "lr": lr, **({"skipped": skipped} if skipped else {})}


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None = None,
                   uncounted: Sequence[nn.Parameter] = ()) -> torch.Tensor:
    """``clip_grad_norm_`` for gradients that live on several meshes.

    Under FSDP the gradients are DTensors; with expert parallelism the expert weights sit on
    the (ep_fsdp, ep) mesh and the dense ones on the flat data-parallel mesh, and DTensor ops
    cannot mix meshes. So: one norm per mesh (made global with ``full_tensor``), combined, and
    every group scaled by the same coefficient. Under pipeline parallelism each rank holds only
    its stages' parameters: the squared norms are summed over ``pp_group`` first, except those
    of gradients sharded over a mesh that spans the pipeline ranks (media encoders colocated on
    every stage, ``media/pipeline_encoders.py``): their norm is already whole on every rank. Parameters in
    ``uncounted`` (copies of a tied parameter, whose gradient another copy already counts) are
    clipped but not counted.
    """
    groups: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for param in params:
        if param.grad is not None:
            groups[getattr(param.grad, "device_mesh", None)].append(param)
    skip = {id(p) for p in uncounted}
    stage_norms, whole_norms = [], []
    pp_ranks = set(dist.get_process_group_ranks(pp_group)) if pp_group is not None else set()
    for mesh, group in groups.items():
        counted = [p.grad for p in group if id(p) not in skip]
        if not counted:
            continue
        norm = torch.nn.utils.get_total_norm(counted, foreach=True)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        spans_pp = mesh is not None and pp_ranks <= set(mesh.mesh.flatten().tolist())
        (whole_norms if pp_group is not None and spans_pp else stage_norms).append(norm)
    if not stage_norms and not whole_norms and pp_group is None:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack(stage_norms)) if stage_norms else torch.zeros(())
    if pp_group is not None:
        squared = total.double() ** 2
        dist.all_reduce(squared, group=pp_group)
        squared += sum((n.double() ** 2 for n in whole_norms), torch.zeros((), dtype=torch.float64))
        total = squared.sqrt().to(total.dtype)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
