"""Neighbour aggregation for message-passing layers, and the graph micro-batch it reads.

A message-passing layer (GCN, GraphSAGE, GCNII) computes, for each of its target nodes, a
weighted sum of its in-neighbours' rows and then transforms it. The sum is the layer's
``aggregate`` injection point (a ``NeighbourAggregation``): the layer hands it its own rows ``h``
(one per target node of the micro-batch) and the micro-batch, and gets one aggregated row per
target. Where the neighbours' rows come from is the engine's business
(``veomni/parallel/graph/halo.py``): this rank's rows, halo rows of other graph partitions exchanged
per layer, and rows of other chunks read from a per-layer history of earlier embeddings. The
model never sees which; it is written once for one process.

A graph micro-batch (one chunk of one graph partition; ``veomni/data/graph/views.py`` makes
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

A *sampled* mini-batch (``veomni/data/graph/sampling.py``) is instead a stack of blocks, one per
layer: layer ``l`` reads ``block_sizes[l]`` source rows and yields ``block_sizes[l + 1]`` target
rows (its targets are the first rows of its sources, as in DGL and PyG), along the edges
``block{l}_edge_index`` / ``block{l}_edge_weight``. ``BlockAggregation`` is the injection point
for it; the layers slice their own rows (residual, root weight) to the aggregate's length.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def aggregate(rows: torch.Tensor, edge_index: torch.Tensor, edge_weight: torch.Tensor, targets: int,
              adjacency: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum over edges (s, t) of weight * rows[s]``, for ``targets`` target rows.

    Differentiable in ``rows``. The kernel is chosen at run time: a sparse CSR matrix product
    (``adjacency``, from ``sparse_adjacency``; 3-4x faster than gathering messages on a CPU, and
    cuSPARSE on a GPU) where torch has one for the dtype, else a gather of per-edge messages and
    a deterministic ``index_add_`` (e.g. bf16 on a CPU).
    """
    flat = rows.reshape(rows.shape[0], math.prod(rows.shape[1:]))  # no -1: empty views have 0 rows
    if adjacency is not None and (rows.is_cuda or rows.dtype in (torch.float32, torch.float64)):
        out = adjacency.to(rows.dtype) @ flat
    else:
        src, dst = edge_index[0], edge_index[1]
        messages = flat.index_select(0, src) * edge_weight.to(rows.dtype).unsqueeze(-1)
        out = flat.new_zeros((targets, flat.shape[1])).index_add_(0, dst, messages)
    return out.reshape(targets, *rows.shape[1:])


def sparse_adjacency(graph: dict, key: str, sources: int, targets: int) -> torch.Tensor:
    """The [targets, sources] CSR matrix of the edges ``graph[key]`` (weights
    ``graph[key.replace("index", "weight")]``), built once per view and kept in it under a
    private key (``_<key>_csr``): the layers of a model share it."""
    cache = f"_{key}_csr"
    matrix = graph.get(cache)
    if matrix is None or matrix.shape != (targets, sources):
        edges, weight = graph[key], graph[key.replace("index", "weight")]
        matrix = torch.sparse_coo_tensor(torch.stack([edges[1], edges[0]]), weight.float(), (targets, sources),
                                         check_invariants=False).coalesce().to_sparse_csr()
        graph[cache] = matrix
    return matrix


def has_stale_edges(graph: Mapping[str, Any]) -> bool:
    stale = graph.get("stale_edge_index")
    return stale is not None and stale.shape[1] > 0


def has_halo(graph: Mapping[str, Any]) -> bool:
    """Whether the view receives or sends halo rows, from the shapes of ``halo_rows`` and
    ``send_index`` (as many rows as ``recv_counts`` and ``send_counts`` add up to): no host read."""
    return any(graph.get(key) is not None and graph[key].shape[0] > 0 for key in ("halo_rows", "send_index"))


class NeighbourAggregation(nn.Module):
    """The injection point: the weighted sum of each target's in-neighbours' rows.

    This default serves one process on a whole view. The engine replaces it in every
    message-passing module the model's plan names (``ParallelPlan.message_passing``) with one
    that also exchanges halo rows and keeps the history (``veomni.parallel.graph.halo``).
    """

    def forward(self, h: torch.Tensor, graph: Mapping[str, Any]) -> torch.Tensor:
        if has_stale_edges(graph) or has_halo(graph):
            raise RuntimeError("this graph micro-batch is a chunk or a partition (it has stale or halo edges); "
                               "its neighbours need the engine's aggregation (veomni.parallel.graph.halo."
                               "apply_graph_parallel), which the trainer installs for models whose plan names "
                               "message_passing modules")
        return _aggregate_edges(h, graph, "edge_index", h.shape[0])


def _aggregate_edges(h: torch.Tensor, graph: Mapping[str, Any], key: str, targets: int) -> torch.Tensor:
    # torch.compile traces no sparse tensor: a compiled layer gathers messages, which it fuses
    adjacency = None if torch.compiler.is_compiling() else sparse_adjacency(graph, key, h.shape[0], targets)
    return aggregate(h, graph[key], graph[key.replace("index", "weight")], targets, adjacency)


class BlockAggregation(nn.Module):
    """The injection point for sampled mini-batches: layer ``index`` sums along its own block's
    edges, from the ``block_sizes[index]`` rows it receives to the ``block_sizes[index + 1]``
    target rows it returns (see the module docstring)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, h: torch.Tensor, graph: Mapping[str, Any]) -> torch.Tensor:
        key = f"block{self.index}_edge_index"
        if key not in graph:
            raise RuntimeError(f"message-passing layer {self.index} needs {key!r}: the mini-batch holds "
                               f"{int(graph['block_sizes'].numel()) - 1 if 'block_sizes' in graph else 0} blocks; "
                               "sample as many hops (data fanouts) as the model has message-passing layers")
        sources, targets = (int(n) for n in graph["block_sizes"][self.index:self.index + 2])
        if h.shape[0] != sources:
            raise RuntimeError(f"message-passing layer {self.index} received {h.shape[0]} rows, its block has "
                               f"{sources} source nodes")
        return _aggregate_edges(h, graph, key, targets)
