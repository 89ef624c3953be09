"""Regression with a summed squared error, one loss unit per row.

The batch contract tells the engine what a micro-batch is: rows (``unit="sample"``, so
throughput is reported as ``samples_per_s``), with ``x`` and ``y`` running along the row
dimension. ``prepare`` draws the input-noise augmentation from the generator the engine passes
(seeded by seed, step, micro-batch and data-parallel rank), so a resumed run adds exactly the
noise the uninterrupted run added. The baseline an eval loss is read against is the error of
predicting every target by the eval targets' mean: their variance, summed over target columns.
"""

from __future__ import annotations

import torch
from torch import nn

from veomni.plugin_api import Baseline, BatchContract, LossOutput

REGRESSION_CONTRACT = BatchContract(unit="sample", sequence_fields=("x", "y"), stage_input="x", target="y")


class RegressionTask:
    contract = REGRESSION_CONTRACT

    def __init__(self, input_noise: float) -> None:
        self.input_noise = input_noise

    def prepare(self, batch: dict, generator: torch.Generator | None = None, training: bool = True) -> dict:
        """``x`` plus Gaussian noise of std ``input_noise``: an augmentation, so training batches only
        (none without a generator either: tests, tools)."""
        if generator is None or self.input_noise == 0 or not training:
            return batch
        noise = torch.randn(batch["x"].shape, generator=generator, dtype=batch["x"].dtype)
        return {**batch, "x": batch["x"] + self.input_noise * noise}

    def count_loss_units(self, batch: dict) -> int:
        return int(batch["y"].shape[0])

    def __call__(self, model: nn.Module, batch: dict) -> LossOutput:
        return LossOutput(self.output_loss(model(batch["x"]), batch["y"]), self.count_loss_units(batch))

    def output_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output.float() - target.float()).pow(2).sum()

    def output_metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
        """Eval metrics from the output alone (a pipeline's last stage): none beyond the loss here."""
        return {}

    def baseline_stats(self, batch: dict) -> torch.Tensor:
        """``[rows, column sums..., column sums of squares...]`` of the targets."""
        y = batch["y"].double().reshape(batch["y"].shape[0], -1)
        return torch.cat([torch.tensor([y.shape[0]], dtype=torch.float64), y.sum(0), y.pow(2).sum(0)])

    def baseline_loss(self, stats: torch.Tensor) -> Baseline | None:
        rows, sums, squares = stats[0], *stats[1:].view(2, -1)
        if rows == 0:
            return None
        variance = float((squares / rows - (sums / rows) ** 2).sum())
        return Baseline(loss=variance, name="the targets' mean alone",
                        meaning="The squared error of predicting every eval target by the mean of the eval targets "
                                "(their variance); below it, the model uses its inputs.")
