"""The ``graph`` dataset kind with ``data.graph_fanouts`` set: sampled mini-batch training.

Each data-parallel rank samples around its own partition's training nodes (the partition the
full-graph modes use: ``data.graph_partitioner``, seeded by ``train.seed``): an epoch is one pass
over them in mini-batches of about ``data.graph_batch_size`` targets, each with its sampled blocks
(``veomni/data/graph/sampling.py``); a micro-batch is one mini-batch. Every rank takes the same
number of mini-batches per epoch, that of the partition with the most training nodes (a smaller
partition's mini-batches are a little smaller), so the ranks stay in step.

Eval: the validation and test nodes of the rank's partition, in mini-batches of the same size with
the *whole* neighbourhood at every hop (fanouts -1): each target gets exactly its full-graph output.
``labels`` are the validation nodes', ``test_labels`` the test nodes'.

Features are read through a ``FeatureStore`` (``veomni/data/graph/features.py``): the matrix in
memory or memory-mapped (``data.graph_features``), for training behind a cache of
``data.graph_cache_rows`` rows on the training device (``data.graph_cache_policy``); the targets
come shuffled or in BGL's proximity-aware order (``data.graph_batch_order``). Training
mini-batches are made ``data.graph_prefetch`` ahead on a background thread
(``veomni/data/graph/prefetch.py``). Each reports what it read and how long the step waited for it
(``STEP_STATS``: ``FEATURE_METRICS``, ``data_wait_s``, ``data_wait_fraction``).

Resume: a mini-batch is a function of (seed, partition, epoch, index), so the state is the position
(epoch, index) and a resumed run yields exactly the mini-batches an uninterrupted one would. A run
with another data-parallel size or batch count resumes at the epoch boundary.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from veomni.data.graph.features import CachedFeatures, FeatureStore, TensorFeatures
from veomni.data.graph.prefetch import Prefetcher
from veomni.data.graph.sampling import NeighbourSampler
from veomni.data.graph.source import checked_manifest, sampled_graph
from veomni.data.graph.views import split_labels
from veomni.data.kinds import STEP_STATS, DatasetRequest, ResumableDataset
from veomni.errors import BadConfig

STATE_FORMAT = "veomni.graph_sampled.v1"
FEATURE_METRICS = {"sampled_feature_rows": "rows", "cross_partition_rows": "remote_rows",
                   "feature_bytes_read": "bytes_read", "feature_load_s": "load_s"}
"""Per-step metrics (summed over micro-batches and ranks) <- ``FeatureStore.stats()`` counters; and
the ratios ``cross_partition_fraction`` (remote rows / rows) and ``feature_cache_hit_rate`` (hits / rows)."""


def training_device() -> torch.device:
    """Where the feature cache lives: the process's current GPU, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class SampledGraphDataset(ResumableDataset):
    """One rank's sampled mini-batches of a graph (the module docstring)."""

    state_format = STATE_FORMAT
    consumer_bound = False  # every rank is at the same (epoch, index)

    def __init__(self, request: DatasetRequest) -> None:
        super().__init__(request.dp_rank, request.dp_size)
        cfg = request.cfg
        manifest = checked_manifest(cfg, request.path, request.model_config)
        graph, edges, part = sampled_graph(
            str(Path(request.path).resolve()), manifest["files"]["graph.safetensors"]["sha256"],
            request.model_config.neighbour_norm, cfg.graph_partitioner, request.dp_size, request.seed,
            cfg.graph_features == "mmap")
        self.split, self.prefetch = request.split, cfg.graph_prefetch
        if request.split == "train":
            mask, fanouts = graph.train_mask, cfg.graph_fanouts
            fields = {"labels": split_labels(graph.y, graph.train_mask)}
        else:
            mask, fanouts = graph.val_mask | graph.test_mask, [-1] * len(cfg.graph_fanouts)
            fields = {"labels": split_labels(graph.y, graph.val_mask),
                      "test_labels": split_labels(graph.y, graph.test_mask)}
        largest = int(torch.bincount(part[mask], minlength=request.dp_size).max())
        self.batches = max(1, math.ceil(largest / cfg.graph_batch_size))
        self.features: FeatureStore = TensorFeatures(graph.x, part, request.dp_rank)
        if cfg.graph_cache_rows and request.split == "train":
            self.features = CachedFeatures(self.features, cfg.graph_cache_rows, cfg.graph_cache_policy,
                                           training_device())
        mine = (mask & (part == request.dp_rank)).nonzero()[:, 0]
        self.sampler = NeighbourSampler(edges, mine, {"x": self.features, **fields},
                                        cfg.graph_batch_size, fanouts, request.seed, stream=request.dp_rank,
                                        batches=self.batches, order=self._order(cfg.graph_batch_order),
                                        sequences=cfg.graph_order_sequences)

    def _order(self, train_order: str) -> str:
        """The training order for training; held-out targets always shuffled: an eval of a few
        mini-batches (``train.eval_batches``) in BFS order would score a few neighbourhoods (a few
        classes on a graph with locality), another sample for every training order."""
        return train_order if self.split == "train" else "random"

    def __iter__(self) -> Iterator[dict[str, Any]]:
        start = self.begin()
        if self.split != "train":
            return self._eval()
        return self._train(*start)

    def _eval(self) -> Iterator[dict[str, Any]]:
        self._pos = (1, 0)
        for index in range(self.batches):
            yield self.sampler.batch_at(0, index)

    def _train(self, epoch: int, index: int) -> Iterator[dict[str, Any]]:
        """Every mini-batch from (epoch, index) on, made in the step or ``prefetch`` ahead; each
        says how long the step waited for it and how long the step was (waiting included)."""
        ahead = Prefetcher(self._counted, self._positions(epoch, index), self.prefetch) if self.prefetch else None
        last = None
        try:
            for position in self._positions(epoch, index):
                started = time.perf_counter()
                batch = ahead.get() if ahead is not None else self._counted(position)
                now = time.perf_counter()
                waited, step = now - started, now - last if last is not None else now - started
                batch[STEP_STATS].update(data_wait_s=waited, data_wait_fraction=(waited, step))
                self._pos, last = self._after(position), now
                yield batch
        finally:
            if ahead is not None:
                ahead.close()

    def _positions(self, epoch: int, index: int) -> Iterator[tuple[int, int]]:
        while True:
            for i in range(index, self.batches):
                yield epoch, i
            epoch, index = epoch + 1, 0

    def _after(self, position: tuple[int, int]) -> tuple[int, int]:
        epoch, index = position
        return (epoch, index + 1) if index + 1 < self.batches else (epoch + 1, 0)

    def _counted(self, position: tuple[int, int]) -> dict[str, Any]:
        """The mini-batch at (epoch, index) with what reading it cost (``STEP_STATS``)."""
        before = self.features.stats()
        batch = self.sampler.batch_at(*position)
        after = self.features.stats()
        delta = {key: after[key] - before[key] for key in after}
        batch[STEP_STATS] = {name: delta[key] for name, key in FEATURE_METRICS.items()}
        batch[STEP_STATS].update(cross_partition_fraction=(delta["remote_rows"], delta["rows"]),
                                 feature_cache_hit_rate=(delta["hits"], delta["rows"]))
        return batch

    def position_state(self) -> dict[str, Any]:
        return {**super().position_state(), "batches": self.batches, "partitions": self.dp_size}

    def check_state(self, state: dict[str, Any], consumers: int | None = None) -> None:
        super().check_state(state, consumers)
        if state["index"] and (state["batches"], state["partitions"]) != (self.batches, self.dp_size):
            raise BadConfig(f"sampled graph loader state is {state['index']} mini-batches into epoch {state['epoch']} "
                            f"of {state['batches']} over {state['partitions']} partitions; this run has "
                            f"{self.batches} over {self.dp_size}: keep data.graph_batch_size and the data-parallel "
                            "size, or resume from a checkpoint taken at an epoch boundary")

    @classmethod
    def merge_positions(cls, states: list[dict[str, Any]]) -> dict[str, Any]:
        """The earliest epoch boundary: partitions and batch counts change with the layout."""
        return {"epoch": min(s["epoch"] for s in states)}

    def start_from(self, merged: dict[str, Any]) -> None:
        self.resume_at((merged["epoch"], 0))
