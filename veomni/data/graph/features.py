"""Where a sampled mini-batch's input features come from: one small interface, ``FeatureStore``.

Sampled training reads the feature rows of each mini-batch's input nodes (the sources of its
first block), not the whole matrix. ``gather(node_ids)`` returns those rows; ``stats()`` returns
counters summed since the store was made, which the dataset turns into per-step metrics:
``rows`` read, ``remote_rows`` among them owned by another data-parallel partition (a
partition-aware run reads few of those), and what a store adds of its own.

``TensorFeatures`` serves rows of a matrix already in memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class FeatureStore(ABC):
    """Rows of the node-feature matrix by node id, counted (module docstring). ``owner``: each
    node's partition, ``partition``: this reader's; None counts no remote rows."""

    def __init__(self, owner: torch.Tensor | None = None, partition: int = 0) -> None:
        self.owner, self.partition = owner, partition
        self.counts: dict[str, float] = {"rows": 0.0, "remote_rows": 0.0}

    def gather(self, node_ids: torch.Tensor) -> torch.Tensor:
        """[len(node_ids), F] float rows, in the order of ``node_ids``."""
        self.counts["rows"] += node_ids.numel()
        if self.owner is not None:
            self.counts["remote_rows"] += int((self.owner[node_ids] != self.partition).sum())
        return self.read(node_ids)

    @abstractmethod
    def read(self, node_ids: torch.Tensor) -> torch.Tensor:
        """The rows themselves."""

    def stats(self) -> dict[str, float]:
        """Counters since the store was made (a copy)."""
        return dict(self.counts)


class TensorFeatures(FeatureStore):
    """Rows of an in-memory [N, F] matrix."""

    def __init__(self, x: torch.Tensor, owner: torch.Tensor | None = None, partition: int = 0) -> None:
        super().__init__(owner, partition)
        self.x = x

    def read(self, node_ids: torch.Tensor) -> torch.Tensor:
        return self.x[node_ids]
