"""The ``toy_regression`` dataset kind: rows of a ``.pt`` file ``{"x": [N, in], "y": [N, out]}``.

Each data-parallel rank (and loader worker) is one consumer ``c`` of ``C``: an epoch's row order
(shuffled by seed and epoch for training, in file order for eval) is the same everywhere and
consumer ``c`` takes its positions ``i`` with ``i % C == c``, so every consumer reads different
rows. ``data.tokens_per_micro_batch`` rows make one micro-batch (the task's unit is a sample).
Training loops over epochs; eval makes one pass.

Resume is ``ResumableDataset``'s (``veomni/data/resume.py``): the position is that of the first row
not yet yielded, (epoch, index in the epoch's order), which is its default position. The dataset
starts at ``begin()`` and sets ``self._pos`` after each micro-batch; the protocol saves it, loads it
into a fresh dataset of the same layout (the next micro-batch exactly), and at a new layout starts
every consumer at the earliest old position, before which every row was consumed, so no row is
skipped (a few are seen twice).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from veomni.plugin_api import DataConfig, DatasetKind, DatasetRequest, ResumableDataset, greedy_pack, register_dataset


def load_rows(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.load(path, weights_only=True)
    return data["x"], data["y"]


class RegressionRows(ResumableDataset):
    state_format = "toy_regression.v1"

    def __init__(self, request: DatasetRequest) -> None:
        super().__init__(request.dp_rank, request.dp_size)
        self.x, self.y = load_rows(request.path)
        self.rows_per_batch = request.cfg.tokens_per_micro_batch
        self.shuffle = request.split == "train" and request.cfg.shuffle
        self.loops = request.split == "train"
        self.seed = request.seed

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.x)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def _rows(self, start: tuple[int, int]) -> Iterator[tuple[int, tuple[int, int]]]:
        """This consumer's rows from ``start`` on, each tagged with its own position."""
        consumer, consumers = self.consumer()
        if len(self.x) < consumers:
            raise ValueError(f"{len(self.x)} rows cannot feed {consumers} consumers (dp ranks x workers)")
        epoch, first = start
        while self.loops or epoch == 0:
            order = self._order(epoch)
            for index in range(first, len(order)):
                if index % consumers == consumer:
                    yield order[index], (epoch, index)
            epoch, first = epoch + 1, 0

    def __iter__(self) -> Iterator[dict]:
        return self._batches(self.begin())

    def _batches(self, start: tuple[int, int]) -> Iterator[dict]:
        for rows, next_position in greedy_pack(self._rows(start), self.rows_per_batch, cost=lambda row: 1):
            self._pos = next_position if next_position is not None else (1, 0)  # eval: after its one pass
            index = torch.tensor(rows)
            yield {"x": self.x[index], "y": self.y[index]}


def check_regression_data(cfg: DataConfig, model_config: Any) -> list[str]:
    """Before any worker starts: every data file has the columns the model takes."""
    problems = []
    for key, path in (("data.train_path", cfg.train_path), ("data.eval_path", cfg.eval_path)):
        if not path or not Path(path).is_file():
            continue
        x, y = load_rows(path)
        if (x.shape[1], y.shape[1]) != (model_config.in_features, model_config.out_features):
            problems.append(f"{key}: {path} has {x.shape[1]} features and {y.shape[1]} targets per row, the "
                            f"model takes model.in_features={model_config.in_features} and "
                            f"model.out_features={model_config.out_features}")
    return problems


register_dataset(DatasetKind("toy_regression", build=RegressionRows, needs_tokenizer=False,
                             check=check_regression_data))
