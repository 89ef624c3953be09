"""Neighbour aggregation for message-passing layers, and the graph micro-batch it reads.

A message-passing layer (GCN, GraphSAGE, GCNII) computes, for each of its target nodes, a
weighted sum of its in-neighbours' rows and then transforms it. The sum is the layer's
``aggregate`` injection point (a ``NeighbourAggregation``): the layer hands it its own rows ``h``
(one per target node of the micro-batch) and the micro-batch, and gets one aggregated row per
target. Where the neighbours' rows come from is the engine's business
(``veomni/parallel/graph.py``): this rank's rows, halo rows of other graph partitions exchanged
per layer, and rows of other chunks read from a per-layer history of earlier embeddings. The
model never sees which; it is written once for one process.

A graph micro-batch (one chunk of one graph partition; ``veomni/data/graph_views.py`` makes
them) is a dict of tensors:

- ``x`` [n, F]: features of the n target nodes; ``labels`` [n]: loss targets (``IGNORE_INDEX``
  where a node has none in this split); ``test_labels`` [n] in eval views.
- ``edge_index`` [2, E] and ``edge_weight`` [E]: edges whose source row is *fresh*: a source
  ``s < n`` is target row ``s`` itself, ``s >= n`` is row ``s - n`` of the halo rows this chunk
  receives from other partitions. Targets index ``[0, n)``. Weights already hold the layer's
  normalisation (GCN's symmetric one with self-loops, or the mean over in-neighbours).
- ``stale_edge_index`` [2, E'] and ``stale_edge_weight`` [E']: edges whose source is read from
  the history table (rows: this partition's nodes, then its halo nodes); empty for a whole view.
- ``node_rows`` [n], ``halo_rows`` [r]: the history-table rows of the targets and of the halo
  rows received, where fresh values are written after use.
- ``send_index`` [s], ``send_counts`` [P], ``recv_counts`` [P]: the halo exchange with the P
  partitions of the data-parallel group (rows of ``h`` to send, grouped by destination).
- ``history_rows`` and ``chunks``: 0-d; the history table's size and the epoch's chunk count.

Exactness: a whole view (one chunk, no stale edges) makes ``aggregate`` the full-graph sum, so a
single process, graph parallelism and a one-chunk pipeline all compute the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


def aggregate(rows: torch.Tensor, edge_index: torch.Tensor, edge_weight: torch.Tensor, targets: int) -> torch.Tensor:
    """``out[t] = sum over edges (s, t) of weight * rows[s]``, for ``targets`` target rows.

    Differentiable in ``rows`` (the gather's backward is the transposed scatter). Pure torch, so
    the same code runs on CPU and GPU; ``index_add_`` is deterministic on CPU.
    """
    src, dst = edge_index[0], edge_index[1]
    messages = rows.index_select(0, src) * edge_weight.to(rows.dtype).unsqueeze(-1)
    out = rows.new_zeros((targets, *rows.shape[1:]))
    return out.index_add_(0, dst, messages)


def has_stale_edges(graph: Mapping[str, Any]) -> bool:
    stale = graph.get("stale_edge_index")
    return stale is not None and stale.shape[1] > 0


def has_halo(graph: Mapping[str, Any]) -> bool:
    recv = graph.get("recv_counts")
    send = graph.get("send_counts")
    return (recv is not None and int(recv.sum()) > 0) or (send is not None and int(send.sum()) > 0)


class NeighbourAggregation(nn.Module):
    """The injection point: the weighted sum of each target's in-neighbours' rows.

    This default serves one process on a whole view. The engine replaces it in every
    message-passing module the model's plan names (``ParallelPlan.message_passing``) with one
    that also exchanges halo rows and keeps the history (``veomni.parallel.graph``).
    """

    def forward(self, h: torch.Tensor, graph: Mapping[str, Any]) -> torch.Tensor:
        if has_stale_edges(graph) or has_halo(graph):
            raise RuntimeError("this graph micro-batch is a chunk or a partition (it has stale or halo edges); "
                               "its neighbours need the engine's aggregation (veomni.parallel.graph."
                               "apply_graph_parallel), which the trainer installs for models whose plan names "
                               "message_passing modules")
        return aggregate(h, graph["edge_index"], graph["edge_weight"], h.shape[0])


@runtime_checkable
class GraphModelConfig(Protocol):
    """What a graph dataset kind reads from the config of the model it feeds."""

    in_features: int
    num_classes: int
    neighbour_norm: str
    """The neighbour normalisation the model's layers expect in ``edge_weight``: ``gcn``,
    ``mean`` or ``sum`` (``veomni.data.graph_views.edge_weights``)."""


@runtime_checkable
class GraphCost(Protocol):
    """What a graph family's cost model adds for ``--dry-run``'s communication and history lines."""

    def stage_width(self, model: nn.Module) -> int:
        """Elements per node that cross a pipeline stage boundary (GCNII's (h, h0): 2 d)."""
        ...

    def history_width(self, model: nn.Module) -> int:
        """Elements per node of one layer's history row (the rows ``aggregate`` receives)."""
        ...

    def aggregations(self, model: nn.Module) -> int:
        """Message-passing layers (history tables; halo exchanges per forward)."""
        ...

    def assumed_degree(self, model: nn.Module) -> float:
        """In-edges per node to plan with before the graph exists."""
        ...
