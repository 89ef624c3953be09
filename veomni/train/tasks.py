"""Tasks turn a batch into a summed loss and the number of tokens it is summed over.

Returning the *sum* (not the mean) lets the trainer divide by the global token count of the
whole step, so the result does not depend on how the batch is split across ranks and
micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


@dataclass
class LossOutput:
    loss_sum: torch.Tensor
    """Sum of per-token losses (differentiable)."""
    num_tokens: int
    """Tokens the sum runs over."""
    metrics: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)
    """Extra named ``(sum, count)`` pairs to report (e.g. the terms of a composite loss); the
    step reports each as its global sum over its global count. Not differentiated."""


class Task(Protocol):
    def prepare(self, batch: dict) -> dict:
        """Add per-token tensors that need the whole packed row (e.g. targets that look ahead),
        before sequence parallelism cuts the row into slices."""
        ...

    def count_tokens(self, batch: dict) -> int: ...

    def __call__(self, model: nn.Module, batch: dict) -> LossOutput: ...


class LanguageModelingTask:
    """Next-token cross entropy on a packed row; labels already shifted, -100 = no target.

    The model also gets the batch's ``valid_tokens`` (set where rows were padded: a
    sequence-parallel slice, a pipeline row; None = no padding), so MoE layers leave padding
    unrouted and out of their statistics."""

    def prepare(self, batch: dict) -> dict:
        return batch

    def count_tokens(self, batch: dict) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def __call__(self, model: nn.Module, batch: dict) -> LossOutput:
        logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], batch["max_seqlen"],
                       valid_tokens=batch.get("valid_tokens"))
        return LossOutput(loss_sum=self.output_loss(logits, batch["labels"]), num_tokens=self.count_tokens(batch))

    def output_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed loss from the model's output alone: what a pipeline's last stage computes."""
        return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def task_for_model(model: nn.Module) -> Task:
    """The model's own task if it declares one (``training_task()``), else language modelling."""
    declare = getattr(model, "training_task", None)
    return declare() if declare is not None else LanguageModelingTask()
