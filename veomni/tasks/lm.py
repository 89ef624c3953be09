"""Language modelling: next-token cross entropy on packed rows of token ids.

Its baseline is the unigram entropy of the eval targets: the cross entropy, in nats per token, of
predicting every target token from how often it occurs among them, the best a model can do that
knows token frequencies and nothing else (even the eval split's own: a model trained on another
split's frequencies does worse). A lower eval loss means the model uses context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from veomni.tasks.base import IGNORE_INDEX, Baseline, BatchContract, LossOutput

LM_CONTRACT = BatchContract(
    unit="token",
    sequence_fields=("input_ids", "labels", "position_ids"),
    pad_values={"labels": IGNORE_INDEX},
    stage_input="input_ids",
    stage_kwargs=("position_ids", "cu_seqlens", "max_seqlen"),
    target="labels",
)
"""A packed row of token ids (``veomni.data.packing``): labels already shifted, -100 = no target."""


def target_counts(labels: torch.Tensor) -> torch.Tensor:
    """How often each token id occurs as a target (index = id; -100 left out)."""
    return torch.bincount(labels[labels != IGNORE_INDEX]).double()


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy summed over the targets that are not ``IGNORE_INDEX`` (fp32 logits)."""
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def frequency_baseline(stats: torch.Tensor, name: str, meaning: str, perplexity: bool = False) -> Baseline | None:
    """The ``Baseline`` of predicting each target from its frequency among the eval targets
    (``stats``: summed ``target_counts``); None without targets."""
    entropy = unigram_entropy(stats)
    if entropy is None:
        return None
    return Baseline(entropy, name, meaning, unit="nats", perplexity=perplexity)


def unigram_entropy(counts: torch.Tensor) -> float | None:
    """Entropy in nats of the distribution ``counts`` / total; None when the total is 0."""
    total = counts.sum()
    if total <= 0:
        return None
    p = counts[counts > 0] / total
    return float(-(p * p.log()).sum())


class LanguageModelingTask:
    """Next-token cross entropy on a packed row; labels already shifted, -100 = no target.

    The model also gets the batch's ``valid_tokens`` (set where rows were padding: a
    sequence-parallel slice, a pipeline row; None = no padding), so MoE layers leave padding
    unrouted and out of their statistics."""

    contract = LM_CONTRACT

    def prepare(self, batch: dict, generator: torch.Generator | None = None, training: bool = True) -> dict:
        return batch

    def count_loss_units(self, batch: dict) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def forward(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """The model's logits [T, vocab] for the row."""
        return model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], batch["max_seqlen"],
                     valid_tokens=batch.get("valid_tokens"))

    def __call__(self, model: nn.Module, batch: dict) -> LossOutput:
        units = self.count_loss_units(batch)  # its host read waits for nothing yet: no forward queued
        logits = self.forward(model, batch)
        return LossOutput(self.output_loss(logits, batch["labels"]), units)

    def output_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return summed_cross_entropy(logits, labels)

    def output_metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
        return {}

    def baseline_stats(self, batch: dict) -> torch.Tensor:
        return target_counts(batch["labels"])

    def baseline_loss(self, stats: torch.Tensor) -> Baseline | None:
        meaning = ("the loss of predicting every eval target token from how often it occurs among the eval "
                   "targets themselves (their unigram entropy), which nothing that ignores context can beat; "
                   "below it, the model uses context")
        return frequency_baseline(stats, "token frequencies alone", meaning, perplexity=True)
