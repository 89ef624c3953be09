"""A task whose pipelined loss reads more of a micro-batch than the last stage's output and target.

Under ``parallel.pp`` the last stage computes the loss from its output alone
(``Task.output_loss(output, target)``). A loss over whole samples (a preference pair's summed
log-probabilities) also needs where each sample lies in the row and fields that take a pass of
their own before the loss (a frozen reference's log-probabilities, computed once per batch). Such
a task is a ``RowLossTask``: the pipeline hands it this rank's rows before a step's or an eval's
forwards (``row_fields``, on every rank of the pipeline, so it may run forward-only passes through
the stages) and computes the loss from the last stage's output and the whole row (``row_loss``).

``StagedModel`` is what a pipeline offers such a task (``veomni/parallel/pipeline/stages.py``'s
``Pipeline`` is one): this rank's modules and a forward-only walk of rows through the stages, with
the policy's stages or another set cut the same way (a frozen reference's).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from veomni.tasks.base import LossOutput, Task


class StagedModel(Protocol):
    """A pipelined model as an objective sees it."""

    parts: list[nn.Module]
    """This rank's stage modules, in the order of its stage indices."""
    modules: list[nn.Module]
    """Every module this rank holds: its stages, then any encoders run outside them."""

    def forward_rows(self, rows: list[dict[str, Any]],
                     parts: Sequence[nn.Module] | None = None) -> Iterator[torch.Tensor | None]:
        """Per row, forward only, the last stage's output (None on ranks without the last stage);
        ``parts``: stage modules cut like ``parts`` to run instead of them. Every rank of the
        pipeline must draw every item."""
        ...


@runtime_checkable
class RowLossTask(Task, Protocol):
    """A task whose last-stage loss reads the whole micro-batch (module doc)."""

    metric_names: tuple[str, ...]
    """The names of ``row_loss``'s metrics: every rank reduces them, last stage or not."""

    def row_fields(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """This rank's pipeline rows (joined, padded) with the fields ``row_loss`` needs added;
        called on every rank of the pipeline before a step's or an eval's forwards."""
        ...

    def row_loss(self, output: torch.Tensor, row: dict[str, Any]) -> LossOutput:
        """The row's summed loss and metrics from the last stage's ``output``."""
        ...
