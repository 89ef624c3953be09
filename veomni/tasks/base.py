"""What a task is: a batch contract, a loss, and the randomness it may draw.

A task turns a micro-batch into a *summed* loss and the number of loss units it is summed over
(tokens, latent patches, labelled nodes), so the trainer can divide by the global count of the
whole step and the result does not depend on how the batch is split across ranks and
micro-batches.

The batch belongs to the task, not to the engine: the task's ``BatchContract`` says what one
row element is (its unit, for throughput), which fields run along the row (what sequence
parallelism slices and pipelines pad, and with what), how fields that point into the row
follow a split, and what crosses pipeline stage boundaries. The engine works from that
contract and assumes no field names of its own, except
the packed-row conventions ``cu_seqlens`` / ``max_seqlen`` (sample boundaries, kept whole when
a row is sliced) and ``valid_tokens`` (the engine sets it when it pads a row: rows from there
on are padding).

Randomness (diffusion noise and timesteps, condition dropout) is drawn in ``prepare`` from the
generator the engine passes: seeded from (seed, step, micro-batch, data-parallel rank), so it
differs across data-parallel ranks, is identical inside a sequence-parallel group and across
pipeline stages (they share a data-parallel rank and run ``prepare`` on the whole row), and is
replayed exactly after a resume.

A task also names the loss a model would reach without learning anything from its inputs (the
``Baseline``: token frequencies for language modelling, the targets' mean for regression), so the
end-of-run summary can say what the eval loss means. It is computed from the same eval batches:
the task sums statistics of each batch's targets (``baseline_stats``), the engine adds them over
the batches and ranks, and the task turns the total into a loss (``baseline_loss``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

IGNORE_INDEX = -100
"""Label value that is no target (the convention of ``torch.nn.functional.cross_entropy``)."""


@dataclass
class LossOutput:
    loss_sum: torch.Tensor
    """Sum of per-unit losses (differentiable)."""
    loss_units: int
    """Loss units the sum runs over."""
    metrics: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)
    """Extra named ``(sum, count)`` pairs to report (e.g. the terms of a composite loss); the
    step reports each as its global sum over its global count. Not differentiated."""


@dataclass(frozen=True)
class RowPlacement:
    """Where each position of a packed row (padded for the split) lands when ranks split it."""

    holder: torch.Tensor
    """[padded row] the row rank (``cp_rank * sp + sp_rank``) holding each position."""
    local: torch.Tensor
    """[padded row] the position's index in its holder's slice."""
    rank: int
    """This rank's row rank."""


@dataclass(frozen=True)
class BatchContract:
    """The layout of a task's micro-batches, as the engine may rely on it."""

    unit: str
    """What one row element is ("token", "latent_token", "node", "sample"): throughput is reported in
    ``<unit>s_per_s``."""
    sequence_fields: tuple[str, ...]
    """Fields shaped [row length, ...]; the first gives the row length. Sequence parallelism
    slices exactly these; padding appends ``pad_values[name]`` (0 when absent)."""
    pad_values: Mapping[str, float] = field(default_factory=dict)
    stage_input: str | None = None
    """The field the first pipeline stage takes; None: the task cannot run on a pipeline."""
    stage_kwargs: tuple[str, ...] = ()
    """Fields every pipeline stage takes as keyword inputs (whole row; ``valid_tokens`` added)."""
    target: str | None = None
    """The field the last pipeline stage's ``output_loss`` reads."""
    localize: Callable[[Mapping[str, Any], RowPlacement], dict[str, Any]] | None = None
    """For fields that point into the row rather than run along it (an omni batch's placeholder
    positions): (the whole row's batch, where each row position lands) -> the fields to replace
    in one rank's slice. None: the task has no such field."""
    media: str | None = None
    """The field holding a row's media items (``{modality: {"inputs", "positions"}}``, the layout
    of ``veomni.contract.media``): pipelines encode them before the first stage needs the features."""
    loss_unit: str = ""
    """What one loss unit is when it is not a row element ("pair" for a preference loss): the step's
    ``loss_<loss unit>s`` and the eval's ``eval_loss_<loss unit>s`` are named after it; "" = ``unit``."""

    @property
    def loss_units_name(self) -> str:
        """The loss units, plural, as metrics and the summary name them ("tokens", "pairs")."""
        return f"{self.loss_unit or self.unit}s"

    def row_length(self, batch: Mapping[str, Any]) -> int:
        """Elements in the (local) row: the units of work this batch holds."""
        return int(batch[self.sequence_fields[0]].shape[0])

    def pad_value(self, name: str) -> float:
        return self.pad_values.get(name, 0)


@dataclass(frozen=True)
class ChanceLevel:
    """A share among the task's eval metrics and what guessing scores on it: the summary reads
    "<label> 83.3% (<guess>: 50%)"."""

    metric: str
    """The metric's name, without the ``eval_`` prefix ("rewards_accuracy")."""
    label: str
    """What it is, for a newcomer ("held-out pair accuracy")."""
    level: float
    """The share guessing scores, in [0, 1]."""
    guess: str
    """Who guesses ("a coin")."""


@dataclass(frozen=True)
class Baseline:
    """The eval loss of a predictor that ignores the inputs, computed from the eval targets."""

    loss: float | None
    """In the units of ``eval_loss`` (the task's loss, averaged over its loss units); None when the
    loss has no model-free value and only ``chance`` levels are known."""
    name: str
    """The predictor in a few words, read after "6.12 for": "token frequencies alone"."""
    meaning: str
    """One sentence for a newcomer: what the baseline is and what a loss below it shows."""
    unit: str = ""
    """The loss's unit ("nats"); "" when it has none worth naming."""
    perplexity: bool = False
    """The loss is a mean negative log-likelihood in nats: ``exp(loss)`` is reported as perplexity."""
    chance: tuple[ChanceLevel, ...] = ()
    """Eval metrics (shares) whose level without learning is known: the summary states each against it."""


class Task(Protocol):
    contract: BatchContract

    def prepare(self, batch: dict, generator: torch.Generator | None = None, training: bool = True) -> dict:
        """Add what needs the whole row or randomness (look-ahead targets, noise, timesteps),
        before sequence parallelism cuts the row into slices. ``generator`` is the engine's
        (CPU) generator for this micro-batch; None outside training (tests, tools). ``training``
        is False for eval batches: augmentation (input noise, crops, masking meant to regularise)
        belongs to training batches only; what the loss itself needs (a diffusion task's noise and
        timesteps) is drawn either way."""
        ...

    def count_loss_units(self, batch: dict) -> int: ...

    def __call__(self, model: nn.Module, batch: dict) -> LossOutput: ...

    def output_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Summed loss from the model's output alone: what a pipeline's last stage computes."""
        ...

    def output_metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
        """The task's eval metrics as ``LossOutput.metrics`` pairs, from the model's output alone: what a
        pipeline's last stage reports in eval ({} for none). Padding rows (``contract.pad_values``)
        must add nothing."""
        ...

    def baseline_stats(self, batch: dict) -> torch.Tensor:
        """Sums over this eval batch's loss targets that ``baseline_loss`` needs: e.g. a count
        per token id, or ``[count, sum, sum of squares]`` of scalar targets. The engine adds these
        tensors over the eval batches and over the ranks that split the data (data and sequence
        parallel: under sequence parallelism ``batch`` is this rank's slice of the row). The
        sizes may differ between batches and ranks along any dimension (a batch holds the ids it
        holds): smaller tensors are zero-padded at the end to the largest before adding."""
        ...

    def baseline_loss(self, stats: torch.Tensor) -> Baseline | None:
        """The baseline from the summed ``baseline_stats`` of every eval batch of every rank (a
        float64 tensor on the batches' device); None when there is none (no loss targets)."""
        ...


@dataclass(frozen=True)
class EvalBatch:
    """One eval micro-batch of a rank as the runners score it. ``counted=False``: a repeat that keeps
    a rank whose share of the held-out set ended in step with the others (its loss, metrics and
    baseline statistics are left out); ``samples``: the held-out samples it holds."""

    batch: dict[str, Any]
    samples: int = 0
    counted: bool = True


def count_samples(batch: Mapping[str, Any], contract: BatchContract) -> int:
    """Samples in a loader batch (before any slicing): its packed samples (``cu_seqlens``), a
    sampled graph mini-batch's target nodes (``targets``: its rows are the input nodes of the
    sampled blocks, the throughput unit, most of them there only as neighbours), else one per row
    element (a node of a full graph, an image)."""
    if "cu_seqlens" in batch:
        return int(batch["cu_seqlens"].numel()) - 1
    if "targets" in batch:
        return int(batch["targets"].numel())
    return contract.row_length(batch)


def task_generator(seed: int, step: int, micro_batch: int, dp_rank: int, stream: str = "train") -> torch.Generator:
    """The CPU generator a task draws from for one micro-batch: a hash of all five inputs, so
    streams never overlap by accident (``stream="eval"`` keeps eval draws apart from training)."""
    key = f"{stream}:{seed}:{step}:{micro_batch}:{dp_rank}".encode()
    value = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)
    return torch.Generator().manual_seed(value)


def batch_to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Every tensor of the batch, nested ones included (an omni batch's ``media`` inputs)."""
    def move(value: Any) -> Any:
        if torch.is_tensor(value):
            return value.to(device, non_blocking=True)
        return {k: move(v) for k, v in value.items()} if isinstance(value, dict) else value

    return move(batch)
