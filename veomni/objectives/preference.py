"""Preference optimisation (``train.objective: dpo | ipo | simpo``) on the family's own task.

A micro-batch from the ``chat_preference`` kind (or ``chat_media_preference``, images and videos in
the prompt, for the VLM families) is a packed row whose samples come in pairs: sample ``2k`` is
pair ``k``'s prompt with its chosen reply, sample ``2k + 1`` the same prompt with its rejected reply,
labels only on the replies (``veomni/data/chat/preference_dataset.py``, ``media_preference.py``). The
family's task gives the token logits (``LogitsTask.forward``); this task turns them into each
reply's summed log-probability and the pair losses of ``preference_loss.py``.

A reply's log-probability is a sum over its tokens and the losses are non-linear in it, so the
sum must be whole before the loss. ``prepare`` (on the whole row, before any split) marks each
position with its sample (``sample_index``, a sequence field, so sequence and context parallelism
slice it with the tokens); each rank sums its own positions per sample and the sums are completed
over the ranks holding the row's pieces with a differentiable all-reduce (its backward sums the
gradients the same way). Every such rank then holds every pair's loss and counts every pair, so
the step's usual normalisation (global loss units, gradients averaged over data x row ranks)
gives the gradient of the mean pair loss.

The reference log-probabilities are computed once per micro-batch, without gradients, by the
frozen copy of the starting model, or under LoRA by the policy with its adapters switched off.
Loss units are pairs; metrics (``rewards_chosen``, ``rewards_rejected``, ``rewards_margin``,
``rewards_accuracy``, ``logps_chosen``, ``logps_rejected``) are means over pairs, in
``metrics.jsonl`` and at eval (``eval_`` prefix). The baseline is the loss of a policy that prefers
neither reply (``ln 2`` for DPO), and the accuracy's is a coin's 50%.
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
from veomni.objectives.preference_loss import (
    PREFERENCE_LOSSES,
    PairLogps,
    PairLossFn,
    PreferenceOptions,
    indifferent_loss,
)
from veomni.objectives.registry import FrozenModels, Objective, ObjectiveRequest, register_objective
from veomni.tasks.base import IGNORE_INDEX, Baseline, LossOutput, Task

SAMPLE_INDEX = "sample_index"
"""Sequence field: the packed sample each position belongs to (-1 on padding)."""


@runtime_checkable
class LogitsTask(Task, Protocol):
    """A task whose model gives next-token logits for its row (language modelling, VLM)."""

    def forward(self, model: nn.Module, batch: dict) -> torch.Tensor: ...


def sample_index(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[row length] the packed sample of each position."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)


class PreferenceTask:
    """The family's ``LogitsTask`` trained on pairs with one of ``PREFERENCE_LOSSES``."""

    def __init__(self, inner: LogitsTask, loss: PairLossFn, options: PreferenceOptions) -> None:
        self.inner, self.loss, self.options = inner, loss, options
        contract = inner.contract
        self.contract = replace(contract, sequence_fields=(*contract.sequence_fields, SAMPLE_INDEX),
                                pad_values={**contract.pad_values, SAMPLE_INDEX: -1}, stage_input=None)
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

    def prepare(self, batch: dict, generator: torch.Generator | None = None, training: bool = True) -> dict:
        batch = self.inner.prepare(batch, generator, training)
        samples = int(batch["cu_seqlens"].numel()) - 1
        if samples % 2:
            raise ValueError(f"a preference micro-batch holds {samples} samples: pairs (chosen, rejected) must come "
                             "whole; read the data with the chat_preference or chat_media_preference kind")
        return {**batch, SAMPLE_INDEX: sample_index(batch["cu_seqlens"])}

    def count_loss_units(self, batch: dict) -> int:
        return (int(batch["cu_seqlens"].numel()) - 1) // 2

    def token_logps(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """[local row] log-probability of each position's target (0 where there is none)."""
        logits = self.inner.forward(model, batch)
        return -F.cross_entropy(logits.float(), batch[self.labels], ignore_index=IGNORE_INDEX, reduction="none")

    def sample_sums(self, token_logps: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Per packed sample: the summed log-probability of its targets and their count, completed over
        the ranks holding pieces of the row (the sum differentiably)."""
        samples = int(batch["cu_seqlens"].numel()) - 1
        index = batch[SAMPLE_INDEX]
        targets = (batch[self.labels] != IGNORE_INDEX) & (index >= 0)
        where = index[targets]
        sums = token_logps.new_zeros(samples).index_add(0, where, token_logps[targets])
        counts = token_logps.new_zeros(samples).index_add(0, where, torch.ones_like(where, dtype=sums.dtype))
        if self.row_group is not None:
            sums = dist_nn.all_reduce(sums, group=self.row_group)
            dist.all_reduce(counts, group=self.row_group)
        return sums, counts

    def pair_logps(self, model: nn.Module, batch: dict) -> PairLogps:
        sums, counts = self.sample_sums(self.token_logps(model, batch), batch)
        ref = (None, None)
        if self.reference is not None:
            with torch.no_grad():
                ref_sums = self.sample_sums(self.reference(batch), batch)[0]
            ref = (ref_sums[0::2], ref_sums[1::2])
        return PairLogps(sums[0::2], sums[1::2], counts[0::2], counts[1::2], *ref)

    def __call__(self, model: nn.Module, batch: dict) -> LossOutput:
        pairs = self.pair_logps(model, batch)
        out = self.loss(pairs, self.options)
        count = len(out.losses)
        chosen, rejected = out.chosen_rewards, out.rejected_rewards
        metrics = {"rewards_chosen": chosen.sum(), "rewards_rejected": rejected.sum(),
                   "rewards_margin": (chosen - rejected).sum(), "rewards_accuracy": (chosen > rejected).sum(),
                   "logps_chosen": pairs.chosen.detach().sum(), "logps_rejected": pairs.rejected.detach().sum()}
        return LossOutput(out.losses.sum(), count, {name: (value, count) for name, value in metrics.items()})

    def output_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("preference objectives do not run under a pipeline yet (the launcher refuses it)")

    def output_metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
        raise NotImplementedError("preference objectives do not run under a pipeline yet (the launcher refuses it)")

    def baseline_stats(self, batch: dict) -> torch.Tensor:
        return torch.tensor([float(self.count_loss_units(batch))], dtype=torch.float64)

    def baseline_loss(self, stats: torch.Tensor) -> Baseline | None:
        if float(stats.sum()) <= 0:
            return None
        meaning = ("the loss of a policy that prefers neither reply of a pair (for DPO and IPO: the reference "
                   "itself), where rewards_accuracy is a coin's 50%; below it, the policy ranks the chosen reply "
                   "higher")
        return Baseline(indifferent_loss(self.loss, self.options), "a policy indifferent between the replies", meaning)


def _preference(name: str) -> Callable[[ObjectiveRequest], Objective]:
    loss, needs_reference = PREFERENCE_LOSSES[name]

    def build(request: ObjectiveRequest) -> Objective:
        inner = request.task
        if not isinstance(inner, LogitsTask):
            raise ValueError(f"train.objective={name} needs a task that gives token logits (a LogitsTask: language "
                             f"modelling, VLM); the family's task {type(inner).__name__} does not")
        cfg = request.cfg.preference
        task = PreferenceTask(inner, loss, PreferenceOptions(cfg.beta, cfg.label_smoothing, cfg.simpo_gamma))
        return Objective(name, task, lambda models: task.attach(models, needs_reference))

    return build


for _name, (_, _needs_reference) in PREFERENCE_LOSSES.items():
    register_objective(_name, _preference(_name), frozen_copies=int(_needs_reference),
                       data_kinds=("chat_preference", "chat_media_preference"))
