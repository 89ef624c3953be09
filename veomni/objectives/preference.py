"""Preference optimisation (``train.objective: dpo | ipo | simpo``) on the family's own task.

A micro-batch from the ``chat_preference`` kind is a packed row whose samples come in pairs:
sample ``2k`` is pair ``k``'s prompt with its chosen reply, sample ``2k + 1`` the same prompt with
its rejected reply, labels only on the replies (``veomni/data/chat/preference_dataset.py``). The
family's task gives the token logits (``LogitsTask.forward``); this task turns them into each
reply's summed log-probability and the pair losses of ``preference_loss.py``.

A reply's log-probability is a sum over its tokens, completed over the ranks holding the row's
pieces before the loss (``sequence_logps.py``); the reference is the frozen starting model.
Loss units are pairs; metrics (``rewards_chosen``, ``rewards_rejected``, ``rewards_margin``,
``rewards_accuracy``, ``logps_chosen``, ``logps_rejected``) are means over pairs, in
``metrics.jsonl`` and at eval (``eval_`` prefix). The baseline is the loss of a policy that prefers
neither reply (``ln 2`` for DPO), and the accuracy's is a coin's 50%.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from veomni.objectives.preference_loss import (
    PREFERENCE_LOSSES,
    PairLogps,
    PairLossFn,
    PreferenceOptions,
    indifferent_loss,
)
from veomni.objectives.registry import Objective, ObjectiveRequest, register_objective
from veomni.objectives.sequence_logps import SAMPLE_INDEX, LogitsTask, SequenceLogpsTask, sample_index
from veomni.tasks.base import Baseline, LossOutput


class PreferenceTask(SequenceLogpsTask):
    """The family's ``LogitsTask`` trained on pairs with one of ``PREFERENCE_LOSSES``."""

    def __init__(self, inner: LogitsTask, loss: PairLossFn, options: PreferenceOptions) -> None:
        super().__init__(inner)
        self.loss, self.options = loss, options

    def prepare(self, batch: dict, generator: torch.Generator | None = None, training: bool = True) -> dict:
        batch = self.inner.prepare(batch, generator, training)
        samples = int(batch["cu_seqlens"].numel()) - 1
        if samples % 2:
            raise ValueError(f"a preference micro-batch holds {samples} samples: pairs (chosen, rejected) must come "
                             "whole; read the data with the chat_preference kind")
        return {**batch, SAMPLE_INDEX: sample_index(batch["cu_seqlens"])}

    def count_loss_units(self, batch: dict) -> int:
        return (int(batch["cu_seqlens"].numel()) - 1) // 2

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
    register_objective(_name, _preference(_name), frozen_copies=int(_needs_reference), data_kinds=("chat_preference",))
