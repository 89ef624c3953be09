"""The ``graph`` dataset kind: full-graph node classification, one graph partition per rank.

Every rank loads the whole graph folder (``veomni.data.graph.format``), checks it, normalises the
edges for the model (``model.neighbour_norm``), splits the nodes into ``dp_size`` partitions and
each partition into ``train.grad_accum`` chunks (``data.graph_partitioner``, seeded by
``train.seed``: every rank computes the same assignment), and cuts its own views
(``veomni.data.graph.views.partition_views``). The assignment and views are cached in memory,
per process, keyed by the graph's checksum and every parameter, so the eval loader the trainer
builds at each eval does not repeat the work (nothing is written next to the graph). The same
view dicts are yielded every epoch: a consumer must not modify them in place.

Train: one epoch is one optimizer step of ``train.grad_accum`` micro-batches, and the stream
loops forever. An *exact* epoch (the first ``data.graph_warmup_epochs``, and every
``data.graph_refresh_every``-th) yields the whole view, then ``grad_accum - 1`` empty views; the
other epochs yield the chunk views, in an order shuffled per epoch from ``(seed, epoch)`` (the
same on every rank, as the exchange needs) or fixed (``data.graph_chunk_order``). With one
micro-batch every epoch is the whole view. Labels are the training nodes'.

Eval: the whole view once, ``labels`` the validation nodes', ``test_labels`` the test nodes'.

Resume: the state is the position of the next micro-batch (epoch, index in the epoch). An
epoch's content depends on nothing but its number, and on whether it is the first after a
resume: the per-layer histories (``veomni/parallel/graph/halo.py``) are not checkpointed, so that
epoch is exact, refilling them. A run with another data-parallel layout or chunk count resumes
at the epoch boundary (``merge_states``).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from veomni.data.graph.sampled import SampledGraphDataset
from veomni.data.graph.source import check_graph_data, checked_manifest, prepared_graph
from veomni.data.graph.views import empty_view, partition_views, split_labels
from veomni.data.kinds import DatasetKind, DatasetRequest, ResumableDataset, register_dataset
from veomni.errors import BadConfig

STATE_FORMAT = "veomni.graph.v1"


class GraphDataset(ResumableDataset):
    """One rank's micro-batch stream of a graph (the module docstring)."""

    state_format = STATE_FORMAT
    consumer_bound = False  # every rank's stream is the same sequence of epochs

    def __init__(self, request: DatasetRequest) -> None:
        super().__init__(request.dp_rank, request.dp_size)
        cfg = request.cfg
        manifest = checked_manifest(cfg, request.path, request.model_config)
        self.split, self.seed, self.cfg = request.split, request.seed, cfg
        self.micro_batches = max(request.micro_batches, 1)
        self.chunk_views, self.whole = _rank_views(
            str(Path(request.path).resolve()), manifest["files"]["graph.safetensors"]["sha256"],
            request.model_config.neighbour_norm, cfg.graph_partitioner, request.dp_size, self.micro_batches,
            request.seed, request.dp_rank, request.split, cfg.graph_stale_gradients)
        self._resumed_epoch = -1

    def epoch_views(self, epoch: int) -> list[dict[str, torch.Tensor]]:
        """The micro-batches of one training epoch (one optimizer step)."""
        cfg = self.cfg
        refresh = cfg.graph_refresh_every > 0 and epoch % cfg.graph_refresh_every == 0
        # The histories are not checkpointed: the first epoch after a resume refills them exactly.
        exact = epoch < cfg.graph_warmup_epochs or refresh or epoch == self._resumed_epoch
        if self.micro_batches == 1 or exact:
            return [self.whole] + [empty_view(self.whole)] * (self.micro_batches - 1)
        order = list(range(self.micro_batches))
        if cfg.graph_chunk_order == "shuffled":
            random.Random(f"graph:{self.seed}:{epoch}").shuffle(order)
        return [self.chunk_views[c] for c in order]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """Start at the loaded position (once), else at the beginning; eval is one pass."""
        start = self.begin()
        if self.split != "train":
            return self._eval()
        return self._train(*start)

    def _eval(self) -> Iterator[dict[str, torch.Tensor]]:
        self._pos = (1, 0)
        yield self.whole

    def _train(self, epoch: int, index: int) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            views = self.epoch_views(epoch)
            for i in range(index, len(views)):
                self._pos = (epoch, i + 1) if i + 1 < len(views) else (epoch + 1, 0)
                yield views[i]
            epoch, index = epoch + 1, 0

    def position_state(self) -> dict[str, Any]:
        return {**super().position_state(), "micro_batches": self.micro_batches}

    def resume_at(self, position: tuple[int, int]) -> None:
        super().resume_at(position)
        self._resumed_epoch = position[0] if position[1] == 0 else -1

    def check_state(self, state: dict[str, Any], consumers: int | None = None) -> None:
        super().check_state(state, consumers)
        if state["index"] and state["micro_batches"] != self.micro_batches:
            raise BadConfig(f"graph loader state is {state['index']} micro-batches into epoch {state['epoch']} of "
                            f"{state['micro_batches']}, this run has train.grad_accum={self.micro_batches}; keep "
                            "the old grad_accum, or resume from a checkpoint taken at an optimizer step")

    @classmethod
    def merge_positions(cls, states: list[dict[str, Any]]) -> dict[str, Any]:
        """The earliest epoch boundary any old rank was at: no epoch is skipped, a partly run one
        (only after a mid-step checkpoint) is run again whole."""
        return {"epoch": min(s["epoch"] for s in states)}

    def start_from(self, merged: dict[str, Any]) -> None:
        self.resume_at((merged["epoch"], 0))


@functools.lru_cache(maxsize=2)
def _rank_views(folder: str, sha256: str, norm: str, method: str, parts: int, chunks: int, seed: int, rank: int,
                split: str, stale_gradients: bool) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """(chunk views, whole view) of one rank and split; cached so each eval does not recut them."""
    graph, edges, weights, part, chunk = prepared_graph(folder, sha256, norm, method, parts, chunks, seed)
    if split == "train":
        fields = {"x": graph.x, "labels": split_labels(graph.y, graph.train_mask)}
    else:
        fields = {"x": graph.x, "labels": split_labels(graph.y, graph.val_mask),
                  "test_labels": split_labels(graph.y, graph.test_mask)}
    chunk_views, whole = partition_views(edges, weights, fields, part, parts, rank, chunk, chunks)
    for view in [*chunk_views, whole]:
        view["stale_gradients"] = torch.tensor(stale_gradients)
    return chunk_views, whole


def build_graph_dataset(request: DatasetRequest) -> ResumableDataset:
    """Full-graph views, or sampled mini-batches when the recipe sets ``data.graph_fanouts``."""
    return SampledGraphDataset(request) if request.cfg.graph_fanouts else GraphDataset(request)


register_dataset(DatasetKind("graph", build_graph_dataset, check=check_graph_data))
