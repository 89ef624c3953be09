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

Under a pipeline (``parallel.pp > 1``) the task is a ``RowLossTask`` (``veomni/tasks/staged.py``):
the last stage holds every position of a row (pipelines with split rows are refused at launch), so
it completes each sum alone. Before a step's schedule runs, ``row_fields`` numbers the samples of
the pipeline's joined rows anew and walks every row once, forward only and without gradients,
through the reference's stages (a frozen copy cut like the policy, or under LoRA the policy's own
stages with adapters off); the last stage keeps the reference's per-sample sums in the row
(``reference_logps``), and ``row_loss`` turns the last stage's logits and those sums into the pair
losses.

The reference log-probabilities are computed once per micro-batch, without gradients, by the
frozen copy of the starting model, or under LoRA by the policy with its adapters switched off.
Loss units are pairs; metrics (``rewards_chosen``, ``rewards_rejected``, ``rewards_margin``,
``rewards_accuracy``, ``logps_chosen``, ``logps_rejected``) are means over pairs, in
``metrics.jsonl`` and at eval (``eval_`` prefix). The baseline is the loss of a policy that prefers
neither reply (``ln 2`` for DPO), and the accuracy's is a coin's 50%.
"""

from __future__ import annotations

import contextlib
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
    chosen_nll,
    indifferent_loss,
)
from veomni.objectives.registry import FrozenModels, Objective, ObjectiveRequest, register_objective
from veomni.tasks.base import IGNORE_INDEX, Baseline, ChanceLevel, LossOutput, Task
from veomni.tasks.staged import StagedModel

SAMPLE_INDEX = "sample_index"
"""Sequence field: the packed sample each position belongs to (-1 on padding)."""
REFERENCE_LOGPS = "reference_logps"
"""Pipeline row field, on the last stage: the reference's summed log-probability of each sample."""
PAIR_METRICS = ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy", "logps_chosen",
                "logps_rejected")


@runtime_checkable
class LogitsTask(Task, Protocol):
    """A task whose model gives next-token logits for its row (language modelling, VLM)."""

    def forward(self, model: nn.Module, batch: dict) -> torch.Tensor: ...


def sample_index(cu_seqlens: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """[row length] the packed sample of each position; -1 on the padding up to ``length``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    index = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)
    return index if length is None else F.pad(index, (0, length - len(index)), value=-1)


class PreferenceTask:
    """The family's ``LogitsTask`` trained on pairs with one of ``PREFERENCE_LOSSES``; under a
    pipeline a ``RowLossTask`` (``veomni/tasks/staged.py``)."""

    def __init__(self, inner: LogitsTask, loss: PairLossFn, options: PreferenceOptions) -> None:
        self.inner, self.loss, self.options = inner, loss, options
        self.metric_names = PAIR_METRICS + (("nll_chosen",) if options.rpo_alpha else ())
        contract = inner.contract
        self.contract = replace(contract, sequence_fields=(*contract.sequence_fields, SAMPLE_INDEX),
                                pad_values={**contract.pad_values, SAMPLE_INDEX: -1}, loss_unit="pair")
        self.labels = contract.target or "labels"
        self.reference: Callable[[dict], torch.Tensor] | None = None
        """batch -> the reference's per-token log-probabilities (set by ``attach``; None: reference-free)."""
        self.staged_reference: Callable[[list[dict]], list[torch.Tensor | None]] | None = None
        """Under a pipeline: rows -> per row, the reference's per-sample sums (None off the last stage)."""
        self.row_group: dist.ProcessGroup | None = None

    def attach(self, models: FrozenModels, needs_reference: bool) -> None:
        self.row_group = models.row_group
        if not needs_reference:
            return
        if models.pipeline is not None:
            self.staged_reference = self._staged_reference(models, models.pipeline)
        elif models.adapters:
            policy = models.policy

            def reference(batch: dict) -> torch.Tensor:
                with adapters_disabled(policy):
                    return self.token_logps(policy, batch)
            self.reference = reference
        else:
            copy = models.frozen_copy()
            self.reference = lambda batch: self.token_logps(copy, batch)

    def _staged_reference(self, models: FrozenModels,
                          pipeline: StagedModel) -> Callable[[list[dict]], list[torch.Tensor | None]]:
        """The reference walked through the stages once per row: the policy's own stages with their
        adapters off under LoRA, else a frozen copy's stages cut like the policy's."""
        parts = None if models.adapters else list(models.frozen_copy())
        modules = nn.ModuleList(pipeline.modules)
        switch = (lambda: adapters_disabled(modules)) if models.adapters else contextlib.nullcontext

        @torch.no_grad()
        def reference(rows: list[dict]) -> list[torch.Tensor | None]:
            with switch():
                return [None if out is None else self.sample_sums(self.logits_logps(out, row), row)[0]
                        for row, out in zip(rows, pipeline.forward_rows(rows, parts))]
        return reference

    def prepare(self, batch: dict, generator: torch.Generator | None = None, training: bool = True) -> dict:
        batch = self.inner.prepare(batch, generator, training)
        samples = int(batch["cu_seqlens"].numel()) - 1
        if samples % 2:
            raise ValueError(f"a preference micro-batch holds {samples} samples: pairs (chosen, rejected) must come "
                             "whole; read the data with the chat_preference or chat_media_preference kind")
        return {**batch, SAMPLE_INDEX: sample_index(batch["cu_seqlens"])}

    def count_loss_units(self, batch: dict) -> int:
        return (int(batch["cu_seqlens"].numel()) - 1) // 2

    def logits_logps(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """[local row] log-probability of each position's target (0 where there is none)."""
        return -F.cross_entropy(logits.float(), batch[self.labels], ignore_index=IGNORE_INDEX, reduction="none")

    def token_logps(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return self.logits_logps(self.inner.forward(model, batch), batch)

    def sample_sums(self, token_logps: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sample of the row's pairs: the summed log-probability of its targets and their count,
        completed over the ranks holding pieces of the row (the sum differentiably)."""
        samples = 2 * self.count_loss_units(batch)  # a pipeline's filler row holds one sample and no pair
        index = batch[SAMPLE_INDEX]
        targets = (batch[self.labels] != IGNORE_INDEX) & (index >= 0) & (index < samples)
        where = index[targets]
        sums = token_logps.new_zeros(samples).index_add(0, where, token_logps[targets])
        counts = token_logps.new_zeros(samples).index_add(0, where, torch.ones_like(where, dtype=sums.dtype))
        if self.row_group is not None:
            sums = dist_nn.all_reduce(sums, group=self.row_group)
            dist.all_reduce(counts, group=self.row_group)
        return sums, counts

    def pairs(self, token_logps: torch.Tensor, batch: dict, ref_sums: torch.Tensor | None) -> PairLogps:
        sums, counts = self.sample_sums(token_logps, batch)
        ref = (None, None) if ref_sums is None else (ref_sums[0::2], ref_sums[1::2])
        return PairLogps(sums[0::2], sums[1::2], counts[0::2], counts[1::2], *ref)

    def pair_logps(self, model: nn.Module, batch: dict) -> PairLogps:
        token_logps = self.token_logps(model, batch)
        ref_sums = None
        if self.reference is not None:
            with torch.no_grad():
                ref_sums = self.sample_sums(self.reference(batch), batch)[0]
        return self.pairs(token_logps, batch, ref_sums)

    def pair_loss(self, pairs: PairLogps) -> LossOutput:
        out = self.loss(pairs, self.options)
        losses, count = out.losses, len(out.losses)
        chosen, rejected = out.chosen_rewards, out.rejected_rewards
        values = (chosen.sum(), rejected.sum(), (chosen - rejected).sum(), (chosen > rejected).sum(),
                  pairs.chosen.detach().sum(), pairs.rejected.detach().sum())
        metrics = dict(zip(PAIR_METRICS, values))
        if self.options.rpo_alpha:
            nll = chosen_nll(pairs)
            losses = losses + self.options.rpo_alpha * nll
            metrics["nll_chosen"] = nll.detach().sum()
        return LossOutput(losses.sum(), count, {name: (value, count) for name, value in metrics.items()})

    def __call__(self, model: nn.Module, batch: dict) -> LossOutput:
        return self.pair_loss(self.pair_logps(model, batch))

    def row_fields(self, rows: list[dict]) -> list[dict]:
        """A pipeline's rows (joined loader rows, padded): their samples numbered anew across the
        joined rows and, on the last stage, the reference's per-sample sums (one forward-only walk
        of every row through the reference's stages, before the step's forwards)."""
        rows = [{**row, SAMPLE_INDEX: sample_index(row["cu_seqlens"], self.contract.row_length(row))} for row in rows]
        if self.staged_reference is None:
            return rows
        return [row if ref is None else {**row, REFERENCE_LOGPS: ref}
                for row, ref in zip(rows, self.staged_reference(rows))]

    def row_loss(self, output: torch.Tensor, row: dict) -> LossOutput:
        """A pipeline row's pair losses from the last stage's logits."""
        return self.pair_loss(self.pairs(self.logits_logps(output, row), row, row.get(REFERENCE_LOGPS)))

    def output_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise TypeError("a preference loss reads whole pairs: pipelines call row_loss (a RowLossTask)")

    def output_metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
        raise TypeError("a preference loss reads whole pairs: pipelines call row_loss (a RowLossTask)")

    def baseline_stats(self, batch: dict) -> torch.Tensor:
        return torch.tensor([float(self.count_loss_units(batch))], dtype=torch.float64)

    def baseline_loss(self, stats: torch.Tensor) -> Baseline | None:
        if float(stats.sum()) <= 0:
            return None
        meaning = ("the loss of a policy that prefers neither reply of a pair (for DPO and IPO: the reference "
                   "itself), where rewards_accuracy is a coin's 50%; below it, the policy ranks the chosen reply "
                   "higher")
        # The NLL term of rpo_alpha has no model-free value: only the accuracy's chance level is known.
        loss = None if self.options.rpo_alpha else indifferent_loss(self.loss, self.options)
        return Baseline(loss, "a policy indifferent between the replies", meaning,
                        chance=(ChanceLevel("rewards_accuracy", "held-out pair accuracy", 0.5, "a coin"),))


def _preference(name: str) -> Callable[[ObjectiveRequest], Objective]:
    loss, needs_reference = PREFERENCE_LOSSES[name]

    def build(request: ObjectiveRequest) -> Objective:
        inner = request.task
        if not isinstance(inner, LogitsTask):
            raise ValueError(f"train.objective={name} needs a task that gives token logits (a LogitsTask: language "
                             f"modelling, VLM); the family's task {type(inner).__name__} does not")
        cfg = request.cfg.preference
        options = PreferenceOptions(cfg.beta, cfg.label_smoothing, cfg.simpo_gamma, cfg.rpo_alpha)
        task = PreferenceTask(inner, loss, options)
        return Objective(name, task, lambda models: task.attach(models, needs_reference))

    return build


for _name, (_, _needs_reference) in PREFERENCE_LOSSES.items():
    register_objective(_name, _preference(_name), pipelines=True, frozen_copies=int(_needs_reference),
                       data_kinds=("chat_preference", "chat_media_preference"))
