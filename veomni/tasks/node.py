"""Node classification on a graph: masked cross entropy over the labelled nodes of a split.

A micro-batch is a graph view (``veomni.ops.graph`` lists its fields): ``x`` holds the features
of its target nodes and ``labels`` their classes, ``IGNORE_INDEX`` for nodes outside the split
(training nodes in training views, validation nodes in eval views). The loss is summed over the
labelled nodes and the loss units are those nodes, so the trainer's normalisation by the global
count makes the gradient that of the mean over every training node of the graph, however the
nodes are split into partitions and chunks.

Accuracy is reported beside the loss (``accuracy``: of the training nodes during training, of
the validation nodes at eval, where the summary shows it as ``eval_accuracy``); eval views also
carry ``test_labels``, reported as ``eval_test_accuracy``.

The baseline is the entropy of the eval labels' class frequencies: the loss of a predictor that
knows how common each class is and nothing about the node; below it, the model uses features or
structure.
"""

from __future__ import annotations

import torch
from torch import nn

from veomni.tasks.base import IGNORE_INDEX, Baseline, BatchContract, LossOutput
from veomni.tasks.lm import frequency_baseline, summed_cross_entropy, target_counts

NODE_CONTRACT = BatchContract(unit="node", sequence_fields=("x", "labels"), pad_values={"labels": IGNORE_INDEX},
                              stage_input="x", target="labels")
"""One graph view: node rows ``x``/``labels``; the edges and exchange fields ride with the view."""


def correct_count(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(correct predictions, labelled nodes) over the nodes whose label is not ``IGNORE_INDEX``."""
    keep = labels != IGNORE_INDEX
    correct = (logits.detach().argmax(-1)[keep] == labels[keep]).sum()
    return correct.double(), int(keep.sum())


class NodeClassificationTask:
    contract = NODE_CONTRACT

    def prepare(self, batch: dict, generator: torch.Generator | None = None, training: bool = True) -> dict:
        return batch

    def count_loss_units(self, batch: dict) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def __call__(self, model: nn.Module, batch: dict) -> LossOutput:
        return self.output_result(model(batch["x"], batch), batch)

    def output_result(self, logits: torch.Tensor, batch: dict) -> LossOutput:
        """Loss and accuracies from the model's logits: what a graph pipeline's last stage reports."""
        metrics = self.output_metrics(logits, batch["labels"])
        if "test_labels" in batch:
            metrics["test_accuracy"] = correct_count(logits, batch["test_labels"])
        return LossOutput(self.output_loss(logits, batch["labels"]), self.count_loss_units(batch), metrics)

    def output_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return summed_cross_entropy(logits, labels)

    def output_metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
        return {"accuracy": correct_count(logits, labels)}

    def baseline_stats(self, batch: dict) -> torch.Tensor:
        return target_counts(batch["labels"])

    def baseline_loss(self, stats: torch.Tensor) -> Baseline | None:
        meaning = ("the loss of predicting every validation node's class from how common each class is among "
                   "them (the entropy of the class frequencies); below it, the model uses the node's features "
                   "or its neighbourhood")
        return frequency_baseline(stats, "class frequencies alone", meaning)
