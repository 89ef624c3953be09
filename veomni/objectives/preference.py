"""Preference optimisation (``train.objective: dpo | ipo | simpo``) on the family's own task.

A micro-batch from the ``chat_preference`` kind (or ``chat_media_preference``, images and videos in
the prompt, for the VLM families) is a packed row whose samples come in pairs: sample ``2k`` is
pair ``k``'s prompt with its chosen reply, sample ``2k + 1`` the same prompt with its rejected reply,
labels only on the replies (``veomni/data/chat/preference_dataset.py``, ``media_preference.py``). The
family's task gives the token logits (``LogitsTask.forward``); this task turns them into each
reply's summed log-probability and the pair losses of ``preference_loss.py``.

A reply's log-probability is a sum over its tokens, completed over the ranks holding the row's
pieces before the loss (``sequence_logps.py``).

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

import torch
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
from veomni.objectives.sequence_logps import SAMPLE_INDEX, LogitsTask, SequenceLogpsTask, sample_index
from veomni.tasks.base import Baseline, ChanceLevel, LossOutput
from veomni.tasks.staged import StagedModel

REFERENCE_LOGPS = "reference_logps"
"""Pipeline row field, on the last stage: the reference's summed log-probability of each sample."""
PAIR_METRICS = ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy", "logps_chosen",
                "logps_rejected")


class PreferenceTask(SequenceLogpsTask):
    """The family's ``LogitsTask`` trained on pairs with one of ``PREFERENCE_LOSSES``; under a
    pipeline a ``RowLossTask`` (``veomni/tasks/staged.py``)."""

    def __init__(self, inner: LogitsTask, loss: PairLossFn, options: PreferenceOptions) -> None:
        super().__init__(inner, loss_unit="pair")
        self.loss, self.options = loss, options
        self.metric_names = PAIR_METRICS + (("nll_chosen",) if options.rpo_alpha else ())
        self.staged_reference: Callable[[list[dict]], list[torch.Tensor | None]] | None = None
        """Under a pipeline: rows -> per row, the reference's per-sample sums (None off the last stage)."""

    def attach(self, models: FrozenModels, needs_reference: bool) -> None:
        if models.pipeline is None or not needs_reference:
            super().attach(models, needs_reference)
            return
        self.row_group = models.row_group
        self.staged_reference = self._staged_reference(models, models.pipeline)

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
                return [None if out is None else self.sample_sums(self.target_logps(out, row), row)[0]
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

    def summed_samples(self, batch: dict) -> int:
        return 2 * self.count_loss_units(batch)  # a pipeline's filler row holds one sample and no pair

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
        return self.pair_loss(self.pairs(self.target_logps(output, row), row, row.get(REFERENCE_LOGPS)))

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
