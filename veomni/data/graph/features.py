"""Where a sampled mini-batch's input features come from: one small interface, ``FeatureStore``.

Sampled training reads the feature rows of each mini-batch's input nodes (the sources of its
first block), not the whole matrix. ``gather(node_ids)`` returns those rows; ``stats()`` returns
counters summed since the store was made, which the dataset turns into per-step metrics:
``rows`` asked for, ``remote_rows`` among them owned by another data-parallel partition (a
partition-aware run reads few of those), ``hits`` served from a cache, ``bytes_read`` from the
backing matrix and ``load_s`` spent in ``gather``.

``TensorFeatures`` serves rows of a matrix: in memory, or memory-mapped from the graph folder
(``veomni.data.graph.format.load_graph(..., map_features=True)``: only the pages of the rows read
are paged in). ``CachedFeatures`` keeps a fixed number of rows in a table on the training device
in front of another store, evicting by ``fifo`` (oldest inserted) or ``lru`` (least recently
used); BGL's proximity-aware order (``veomni/data/graph/order.py``) is what makes such a cache hit.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import torch

POLICIES = ("fifo", "lru")


class FeatureStore(ABC):
    """Rows of the node-feature matrix by node id, counted (module docstring). ``owner``: each
    node's partition, ``partition``: this reader's; None counts no remote rows."""

    def __init__(self, owner: torch.Tensor | None = None, partition: int = 0) -> None:
        self.owner, self.partition = owner, partition
        self.counts: dict[str, float] = {"rows": 0.0, "remote_rows": 0.0, "hits": 0.0, "bytes_read": 0.0,
                                         "load_s": 0.0}

    def gather(self, node_ids: torch.Tensor) -> torch.Tensor:
        """[len(node_ids), F] float rows, in the order of ``node_ids``."""
        started = time.perf_counter()
        self.counts["rows"] += node_ids.numel()
        if self.owner is not None:
            self.counts["remote_rows"] += int((self.owner[node_ids] != self.partition).sum())
        rows = self.read(node_ids)
        self.counts["load_s"] += time.perf_counter() - started
        return rows

    @abstractmethod
    def read(self, node_ids: torch.Tensor) -> torch.Tensor:
        """The rows themselves."""

    def stats(self) -> dict[str, float]:
        """Counters since the store was made (a copy)."""
        return dict(self.counts)


class TensorFeatures(FeatureStore):
    """Rows of an [N, F] matrix, in memory or memory-mapped; every row read is counted in bytes."""

    def __init__(self, x: torch.Tensor, owner: torch.Tensor | None = None, partition: int = 0) -> None:
        super().__init__(owner, partition)
        self.x = x

    def read(self, node_ids: torch.Tensor) -> torch.Tensor:
        self.counts["bytes_read"] += node_ids.numel() * self.x[0].numel() * self.x.element_size()
        return self.x[node_ids]


class CachedFeatures(FeatureStore):
    """``capacity`` rows of ``backing`` kept in a table on ``device``; a miss reads ``backing`` and
    takes the slot ``policy`` frees (the oldest insert for ``fifo``, the oldest use for ``lru``).
    The rows of one ``gather`` are served before any is evicted, so a mini-batch larger than the
    cache still reads each of its rows once."""

    def __init__(self, backing: TensorFeatures, capacity: int, policy: str, device: torch.device | None = None) -> None:
        if policy not in POLICIES or capacity < 1:
            raise ValueError(f"feature cache: policy {policy!r} (one of {POLICIES}), capacity {capacity} (>= 1)")
        super().__init__(backing.owner, backing.partition)
        self.backing, self.policy, self.capacity = backing, policy, capacity
        num_nodes, width = backing.x.shape[0], backing.x[0].numel()
        self.table = torch.empty((capacity, width), dtype=backing.x.dtype, device=device)
        self.slot_of = torch.full((num_nodes,), -1, dtype=torch.long)
        self.node_in = torch.full((capacity,), -1, dtype=torch.long)
        # every insert (and, for lru, every use) takes the next tick: the smallest stamp is the row
        # to evict, exactly (-1: an empty slot, taken first)
        self.stamp = torch.full((capacity,), -1, dtype=torch.long)
        self.clock = 0

    def _tick(self, count: int) -> torch.Tensor:
        self.clock += count
        return torch.arange(self.clock - count, self.clock)

    def read(self, node_ids: torch.Tensor) -> torch.Tensor:
        slots = self.slot_of[node_ids]
        hit = slots >= 0
        self.counts["hits"] += int(hit.sum())
        out = self.table.new_empty((node_ids.numel(), self.table.shape[1]))
        out[hit.to(out.device)] = self.table[slots[hit].to(out.device)]
        if self.policy == "lru":
            self.stamp[slots[hit]] = self._tick(int(hit.sum()))
        missing = node_ids[~hit]
        rows = self.backing.gather(missing).to(out.device)
        out[(~hit).to(out.device)] = rows
        keep = min(missing.numel(), self.capacity)  # a miss list longer than the cache keeps its end
        if keep:
            victims = torch.argsort(self.stamp, stable=True)[:keep]
            evicted = self.node_in[victims]
            self.slot_of[evicted[evicted >= 0]] = -1
            self.node_in[victims] = missing[-keep:]
            self.slot_of[missing[-keep:]] = victims
            self.table[victims.to(out.device)] = rows[-keep:]
            self.stamp[victims] = self._tick(keep)
        return out

    def stats(self) -> dict[str, float]:
        return {**self.counts, "bytes_read": self.backing.counts["bytes_read"]}
