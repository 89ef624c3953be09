"""Cut a graph into the views one rank trains on: its partition, split into chunks.

Graph parallelism gives each data-parallel rank one *partition* of the nodes; a layer pipeline
(GNNPipe) cuts each partition into *chunks* that flow through the stages one after another. A
view is one chunk of one partition, in the layout ``veomni.ops.graph`` documents: the chunk's
target nodes, the edges into them split into *fresh* ones (source in the same chunk: this
partition's rows, or halo rows exchanged with the other partitions for this chunk) and *stale*
ones (source in another chunk: read from the per-layer history table), and the exchange plan.

Layout of one partition's history table: its own nodes sorted by (chunk, id), then its halo
nodes (sources of its in-edges owned by other partitions) sorted by (chunk, owner, id). Each
chunk's targets and each chunk's received halo rows are therefore contiguous ranges, and a
sender lists the rows for a receiver in the receiver's order. In chunk c a partition sends every
row of its chunk-c nodes that another partition has in its halo (not only those feeding that
partition's chunk-c targets), so every halo row of the history is refreshed once per epoch: over
an epoch each halo row crosses the network once per layer, as in plain graph parallelism.

A whole view (one chunk) has no stale edges, so one process, graph parallelism and a one-chunk
pipeline compute the exact full-graph layer.
"""

from __future__ import annotations

from typing import Literal

import torch

from veomni.errors import BadConfig
from veomni.tasks.base import IGNORE_INDEX

Normalization = Literal["gcn", "mean", "sum"]
KEY_BOUND = 3_037_000_499
"""The largest id bound whose pair keys ``first * bound + second`` fit in int64."""


def unique_columns(pairs: torch.Tensor, bound: int,
                   return_inverse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(pairs, dim=1, return_inverse=...)`` of a [2, M] tensor of ids in [0, bound):
    the distinct columns sorted (by the first row, then the second) and, asked for, each column's
    slot, through one 1-D unique of the keys ``first * bound + second``. ``unique(dim=1)`` builds a
    tensor object per column while it sorts: on 10M edges 2.3 GiB of small allocations that the
    process keeps after they are freed (docs/gnn.md)."""
    pairs = pairs.long()
    if bound > KEY_BOUND:
        return torch.unique(pairs, dim=1, return_inverse=return_inverse)
    found = torch.unique(pairs[0] * bound + pairs[1], return_inverse=return_inverse)
    keys = found[0] if return_inverse else found
    columns = torch.stack([keys // bound, keys % bound])
    return (columns, found[1]) if return_inverse else columns


def edge_weights(edge_index: torch.Tensor, num_nodes: int, norm: Normalization,
                 given: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(edges, weights) holding a layer's neighbour normalisation, from the whole graph.

    Duplicate edges are merged first (a graph is a set of edges), their ``given`` weights summed
    (absent: 1 each, so a merged edge weighs 1, where ``torch_geometric`` would count it twice).
    ``gcn``: a self-loop of weight 1 added to every node that has none, then
    ``w = d_s^-1/2 g d_t^-1/2`` with d the weighted in-degree counting self-loops
    (``torch_geometric``'s ``gcn_norm``); ``mean``: ``g / d_t`` (GraphSAGE's mean aggregation,
    weighted); ``sum``: ``g``.
    """
    edge_index, slot = unique_columns(edge_index, num_nodes, return_inverse=True)
    given_weight = torch.ones(edge_index.shape[1], dtype=torch.float64)
    if given is not None:
        given_weight = torch.zeros_like(given_weight).index_add_(0, slot, given.double())
    if norm == "gcn":
        has_loop = torch.zeros(num_nodes, dtype=torch.bool)
        has_loop[edge_index[0][edge_index[0] == edge_index[1]]] = True
        missing = (~has_loop).nonzero().squeeze(1)
        edge_index = torch.cat([edge_index, missing.unsqueeze(0).expand(2, -1)], dim=1)
        given_weight = torch.cat([given_weight, torch.ones(missing.numel(), dtype=torch.float64)])
    degree = torch.zeros(num_nodes, dtype=torch.float64).index_add_(0, edge_index[1], given_weight)
    if norm == "gcn":
        inv_sqrt = degree.pow(-0.5).masked_fill(degree == 0, 0)
        weight = inv_sqrt[edge_index[0]] * given_weight * inv_sqrt[edge_index[1]]
    elif norm == "mean":
        weight = given_weight / degree[edge_index[1]]
    elif norm == "sum":
        weight = given_weight
    else:
        raise BadConfig(f"unknown neighbour normalisation {norm!r}; use 'gcn', 'mean' or 'sum'")
    return edge_index, weight.float()


def _order(keys: list[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """``ids`` sorted lexicographically by ``keys`` (most significant first), then by id."""
    order = torch.argsort(ids, stable=True)
    for key in reversed(keys):
        order = order[torch.argsort(key[ids[order]], stable=True)]
    return ids[order]


def partition_views(edge_index: torch.Tensor, edge_weight: torch.Tensor, node_fields: dict[str, torch.Tensor],
                    part: torch.Tensor, num_parts: int, rank: int, chunk: torch.Tensor,
                    num_chunks: int) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """(the ``num_chunks`` chunk views in chunk order, the whole view) of partition ``rank``.

    ``edge_index``/``edge_weight``: the whole graph's normalised edges (``edge_weights``);
    ``node_fields``: per-node tensors [N, ...] to cut for the targets (``x``, ``labels``, ...);
    ``part`` and ``chunk``: each node's partition and chunk. Chunk ids are global: chunk c of every
    partition runs at the same time (the exchange joins them). The whole view covers every chunk
    at once (no stale edges) with the same history-table layout, so training on it is exact and
    refreshes every history row.
    """
    layout = _Layout(edge_index, edge_weight, part.long(), num_parts, rank, chunk.long(), num_chunks)
    views = [layout.view(node_fields, chunk.long() == c) for c in range(num_chunks)]
    return views, layout.view(node_fields, torch.ones_like(part, dtype=torch.bool))


class _Layout:
    """One partition's history table and edges, from which each view is cut."""

    def __init__(self, edge_index: torch.Tensor, edge_weight: torch.Tensor, part: torch.Tensor, num_parts: int,
                 rank: int, chunk: torch.Tensor, num_chunks: int) -> None:
        num_nodes = part.shape[0]
        self.part, self.chunk, self.num_parts, self.num_chunks = part, chunk, num_parts, num_chunks
        src, dst = edge_index[0].long(), edge_index[1].long()
        into = part[dst] == rank
        self.src, self.dst, self.weight = src[into], dst[into], edge_weight[into]
        self.own = _order([chunk], (part == rank).nonzero().squeeze(1))
        self.halo = _order([chunk, part], torch.unique(self.src[part[self.src] != rank]))
        self.n_own = self.own.numel()
        self.table = torch.full((num_nodes,), -1, dtype=torch.long)
        self.table[self.own] = torch.arange(self.n_own)
        self.table[self.halo] = self.n_own + torch.arange(self.halo.numel())
        # every (receiving partition, node) pair this partition must send, one column each
        cross = (part[src] == rank) & (part[dst] != rank)
        self.sends = unique_columns(torch.stack([part[dst[cross]], src[cross]]), max(num_nodes, num_parts))

    def view(self, node_fields: dict[str, torch.Tensor], covered: torch.Tensor) -> dict[str, torch.Tensor]:
        """The view whose targets are this partition's nodes in the covered chunks (a [N] mask)."""
        targets = self.own[covered[self.own]]  # contiguous in the table: chunks are sorted there
        lo, n = (int(self.table[targets[0]]) if targets.numel() else 0), targets.numel()
        received = self.halo[covered[self.halo]]
        received = received[torch.argsort(self.part[received], stable=True)]  # by owner, then (chunk, id)
        position = torch.full_like(self.table, -1)
        position[received] = torch.arange(received.numel())
        mine = covered[self.dst]
        s, d, w = self.src[mine], self.dst[mine], self.weight[mine]
        fresh = covered[s]
        rows = self.table[s]
        fresh_src = torch.where(rows < self.n_own, rows - lo, n + position[s])
        sends = self.sends[:, covered[self.sends[1]]]
        sends = sends[:, torch.argsort(sends[0] * self.chunk.numel() + self.table[sends[1]], stable=True)]
        view = {name: value[targets] for name, value in node_fields.items()}
        view.update(
            edge_index=torch.stack([fresh_src[fresh], self.table[d[fresh]] - lo]),
            edge_weight=w[fresh],
            stale_edge_index=torch.stack([rows[~fresh], self.table[d[~fresh]] - lo]),
            stale_edge_weight=w[~fresh],
            node_rows=self.table[targets],
            halo_rows=self.table[received],
            send_index=self.table[sends[1]] - lo,
            send_counts=torch.bincount(sends[0], minlength=self.num_parts),
            recv_counts=torch.bincount(self.part[received], minlength=self.num_parts),
            history_rows=torch.tensor(self.n_own + self.halo.numel()),
            chunks=torch.tensor(self.num_chunks),
        )
        return view


def split_labels(labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``labels`` where ``mask`` holds, ``IGNORE_INDEX`` elsewhere: one split's loss targets."""
    return torch.where(mask, labels.long(), torch.full_like(labels.long(), IGNORE_INDEX))


def empty_view(template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A view with no nodes shaped like ``template``: an exact epoch's whole view is followed by
    ``chunks - 1`` of these so every step keeps ``train.grad_accum`` micro-batches (the halo
    exchange still runs, with nothing to send)."""
    view = {}
    for name, value in template.items():
        if value.dim() == 0:  # history_rows, chunks, flags
            view[name] = value
        elif name in ("send_counts", "recv_counts"):
            view[name] = torch.zeros_like(value)
        elif name.endswith("edge_index"):
            view[name] = value.new_zeros((2, 0))
        else:
            view[name] = value.new_zeros((0, *value.shape[1:]))
    return view
