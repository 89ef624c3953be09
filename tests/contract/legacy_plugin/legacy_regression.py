"""A model family written against the previous release's plug-in API, kept as its authors wrote it.

It imports ``veomni.spec``, ``veomni.parallel.plan`` and ``veomni.data.registry`` (now
``veomni.contract``, ``veomni.contract.plan``, ``veomni.data.kinds``); its task's ``prepare`` takes
no ``training`` keyword and it has no ``output_metrics``; its dataset keeps its own resume state,
as the previous release's docs taught. ``tests/contract/test_legacy_plugin.py`` launches and
trains it: it must still run, with a deprecation warning for each of those.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from veomni.data.registry import MERGED_KEY, DatasetKind, DatasetRequest, ResumableDataset, register_dataset
from veomni.parallel.plan import ParallelPlan
from veomni.spec import ModelSpec, register_model
from veomni.tasks.base import Baseline, BatchContract, LossOutput

STATE_FORMAT = "legacy_rows.v1"


@dataclass
class LegacyConfig:
    in_features: int = 4
    hidden_size: int = 8
    num_blocks: int = 2
    input_noise: float = 0.1

    def validate(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"model.num_blocks must be >= 1, got {self.num_blocks}")


class LegacyRegressor(nn.Module):
    def __init__(self, config: LegacyConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Linear(config.in_features, config.hidden_size)
        self.blocks = nn.ModuleList(nn.Linear(config.hidden_size, config.hidden_size) for _ in range(config.num_blocks))
        self.head = nn.Linear(config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(blocks=("blocks.*",))

    def init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.1)
                nn.init.zeros_(module.bias)


class LegacyTask:
    contract = BatchContract(unit="sample", sequence_fields=("x", "y"), stage_input="x", target="y")

    def __init__(self, input_noise: float) -> None:
        self.input_noise = input_noise
        self.noisy_batches = 0

    def prepare(self, batch: dict, generator: torch.Generator | None = None) -> dict:
        if generator is None:
            return batch
        self.noisy_batches += 1
        noise = torch.randn(batch["x"].shape, generator=generator, dtype=batch["x"].dtype)
        return {**batch, "x": batch["x"] + self.input_noise * noise}

    def count_loss_units(self, batch: dict) -> int:
        return int(batch["y"].shape[0])

    def __call__(self, model: nn.Module, batch: dict) -> LossOutput:
        return LossOutput(self.output_loss(model(batch["x"]), batch["y"]), self.count_loss_units(batch))

    def output_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output.float() - target.float()).pow(2).sum()

    def baseline_stats(self, batch: dict) -> torch.Tensor:
        y = batch["y"].double().reshape(-1)
        return torch.stack([torch.tensor(float(y.numel()), dtype=torch.float64), y.sum(), y.pow(2).sum()])

    def baseline_loss(self, stats: torch.Tensor) -> Baseline | None:
        rows, total, squares = stats.tolist()
        if rows == 0:
            return None
        return Baseline(loss=squares / rows - (total / rows) ** 2, name="the targets' mean", meaning="variance")


class LegacyCost:
    def batch_flops(self, model: nn.Module, batch: Mapping[str, Any]) -> float:
        return self.sample_flops(model, int(batch["x"].shape[0]))

    def sample_flops(self, model: nn.Module, units: int) -> float:
        return 6.0 * sum(p.numel() for p in model.parameters() if p.dim() == 2) * units

    def activation_bytes_per_unit(self, model: nn.Module, bytes_per_elem: int, checkpointing: str) -> float:
        return bytes_per_elem * model.config.hidden_size * (model.config.num_blocks + 1)

    def activated_params(self, model: nn.Module) -> int:
        return sum(p.numel() for p in model.parameters())

    def report_lines(self, model: nn.Module, units: int) -> list[str]:
        return []


class LegacyRows(ResumableDataset):
    """Rows ``i % consumers == consumer`` in file order; the train split loops. Its own resume state."""

    def __init__(self, request: DatasetRequest) -> None:
        super().__init__(request.dp_rank, request.dp_size)
        data = torch.load(request.path, weights_only=True)
        self.x, self.y = data["x"], data["y"]
        self.rows_per_batch = request.cfg.tokens_per_micro_batch
        self.loops = request.split == "train"
        self._start = self._pos = (0, 0)

    def __iter__(self) -> Iterator[dict]:
        start, self._start = self._start, (0, 0)
        self._pos = start
        consumer, consumers = self.consumer()
        epoch, index = start
        while self.loops or epoch == 0:
            mine = list(range(len(self.x)))[consumer::consumers]
            while index + self.rows_per_batch <= len(mine):
                rows = torch.tensor(mine[index:index + self.rows_per_batch])
                index += self.rows_per_batch
                self._pos = (epoch, index)
                yield {"x": self.x[rows], "y": self.y[rows]}
            epoch, index = epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        consumer, consumers = self.consumer()
        epoch, index = self._pos
        return {"format": STATE_FORMAT, "consumer": consumer, "num_consumers": consumers,
                "epoch": epoch, "index": index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._start = self._pos = (state["epoch"], state["index"])

    @classmethod
    def merge_states(cls, loader_states: list[dict[str, Any]]) -> dict[str, Any]:
        return {MERGED_KEY: (0, 0)}

    def start_from(self, merged: Any) -> None:
        self._start = self._pos = tuple(merged)


register_dataset(DatasetKind("legacy_rows", build=LegacyRows, needs_tokenizer=False))
register_model(ModelSpec(name="legacy_regressor", config_cls=LegacyConfig, build=LegacyRegressor,
                         task=lambda config: LegacyTask(config.input_noise), dataset="legacy_rows",
                         cost=LegacyCost()))
