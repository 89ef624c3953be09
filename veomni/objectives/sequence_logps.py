"""What the preference and RL objectives share: a family's ``LogitsTask`` turned into per-sample
log-probability sums over a packed row, and the frozen reference.

Both kinds of objective need, per packed sample, a sum over its target tokens of something
non-linear in the whole sum (a pair loss, a sequence-mean), so the sum must be whole before the
loss. ``prepare`` (on the whole row, before any split) marks each position with its sample
(``sample_index``, a sequence field, so sequence and context parallelism slice it with the
tokens); each rank sums its own positions per sample and the sums are completed over the ranks
holding the row's pieces with a differentiable all-reduce (its backward sums the gradients the
same way). Every such rank then holds every sample's sum and counts every sample, so the step's
usual normalisation (global loss units, gradients averaged over data x row ranks) gives the
gradient of the mean over samples.

The reference log-probabilities come from the frozen copy of the starting model, or under LoRA
from the policy with its adapters switched off (``attach``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import nn

from veomni.adapters.lora import adapters_disabled
from veomni.objectives.registry import FrozenModels
from veomni.tasks.base import IGNORE_INDEX, Task

SAMPLE_INDEX = "sample_index"
"""Sequence field: the packed sample each position belongs to (-1 on padding)."""


@runtime_checkable
class LogitsTask(Task, Protocol):
    """A task whose model gives next-token logits for its row (language modelling, VLM)."""

    def forward(self, model: nn.Module, batch: dict) -> torch.Tensor: ...


def sample_index(cu_seqlens: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """[row length] the packed sample of each position; -1 on the padding up to ``length``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    index = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)
    return index if length is None else F.pad(index, (0, length - len(index)), value=-1)


class SequenceLogpsTask:
    """Base of the objectives' tasks: the family's ``LogitsTask`` with per-sample sums over its
    targets; ``extra_fields``: further sequence fields of the objective and their pad values;
    ``loss_unit``: what a loss unit is called ("pair"; "" keeps the family's unit)."""

    def __init__(self, inner: LogitsTask, extra_fields: dict[str, float] | None = None, loss_unit: str = "") -> None:
        self.inner = inner
        fields = {SAMPLE_INDEX: -1, **(extra_fields or {})}
        contract = inner.contract
        self.contract = replace(contract, sequence_fields=(*contract.sequence_fields, *fields),
                                pad_values={**contract.pad_values, **fields}, loss_unit=loss_unit)
        self.labels = contract.target or "labels"
        self.reference: Callable[[dict], torch.Tensor] | None = None
        """batch -> the reference's per-token log-probabilities (set by ``attach``; None: reference-free)."""
        self.row_group: dist.ProcessGroup | None = None

    def attach(self, models: FrozenModels, needs_reference: bool) -> None:
        self.row_group = models.row_group
        if not needs_reference:
            return
        if models.adapters:
            policy = models.policy

            def reference(batch: dict) -> torch.Tensor:
                with adapters_disabled(policy):
                    return self.token_logps(policy, batch)
        else:
            copy = models.frozen_copy()

            def reference(batch: dict) -> torch.Tensor:
                return self.token_logps(copy, batch)
        self.reference = reference

    def target_logps(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """[local row] log-probability of each position's target under ``logits`` (0 where there is none)."""
        return -F.cross_entropy(logits.float(), batch[self.labels], ignore_index=IGNORE_INDEX, reduction="none")

    def token_logps(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return self.target_logps(self.inner.forward(model, batch), batch)

    def targets(self, batch: dict) -> torch.Tensor:
        """[local row] bool: the position has a target in a real sample."""
        return (batch[self.labels] != IGNORE_INDEX) & (batch[SAMPLE_INDEX] >= 0)

    def summed_samples(self, batch: dict) -> int:
        """How many of the row's packed samples ``sample_sums`` sums (the first ones)."""
        return int(batch["cu_seqlens"].numel()) - 1

    def sample_sums(self, values: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Per packed sample: the sum of ``values`` over its targets and their count, completed over
        the ranks holding pieces of the row (the sum differentiably)."""
        samples = self.summed_samples(batch)
        targets = self.targets(batch) & (batch[SAMPLE_INDEX] < samples)
        where = batch[SAMPLE_INDEX][targets]
        sums = values.new_zeros(samples).index_add(0, where, values[targets])
        counts = values.new_zeros(samples).index_add(0, where, torch.ones_like(where, dtype=sums.dtype))
        if self.row_group is not None:
            sums = dist_nn.all_reduce(sums, group=self.row_group)
            dist.all_reduce(counts, group=self.row_group)
        return sums, counts

    def output_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("this objective does not run under a pipeline yet (the launcher refuses it)")

    def output_metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
        raise NotImplementedError("this objective does not run under a pipeline yet (the launcher refuses it)")
