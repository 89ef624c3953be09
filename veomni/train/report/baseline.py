"""The eval baseline: the task's statistics of the eval targets, summed over batches and ranks.

A task's ``baseline_stats`` may depend on the data in size (a count per token id seen so far), so
tensors are zero-padded at the end to the largest shape before adding: across ranks that is one
all-reduce of the shape (max) and one of the padded sums, on the batches' device (NCCL needs it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from veomni.tasks.base import Baseline, EvalBatch, Task


def pad_to(tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``tensor`` zero-padded at the end of each dimension to ``shape``."""
    pad: list[int] = []
    for have, want in reversed(list(zip(tensor.shape, shape))):
        pad += [0, int(want) - have]
    return F.pad(tensor, pad)


def add_padded(total: torch.Tensor | None, stats: torch.Tensor) -> torch.Tensor:
    stats = stats.double()
    if total is None:
        return stats
    shape = [max(a, b) for a, b in zip(total.shape, stats.shape)]
    return pad_to(total, shape) + pad_to(stats, shape)


def all_reduce_padded(stats: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The sum of every rank's ``stats`` (same number of dimensions, any sizes)."""
    shape = torch.tensor(stats.shape, dtype=torch.int64, device=stats.device)
    dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=group)
    total = pad_to(stats, shape.tolist()).contiguous()
    dist.all_reduce(total, group=group)
    return total


class BaselineCollector:
    """Passes eval batches through (to the runner) while adding up the task's baseline statistics."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.stats: torch.Tensor | None = None

    def observe(self, batches: Iterable[EvalBatch]) -> Iterator[EvalBatch]:
        for item in batches:
            if item.counted:
                self.stats = add_padded(self.stats, self.task.baseline_stats(item.batch))
            yield item

    def result(self, group: dist.ProcessGroup | None) -> Baseline | None:
        """The baseline over every rank of ``group`` (the ranks that split the eval data). Every
        rank saw the same number of batches, so all of them hold statistics or none does."""
        if self.stats is None:
            return None
        return self.task.baseline_loss(all_reduce_padded(self.stats, group))
