"""Split a graph's nodes into partitions (one per data-parallel rank) and partitions into chunks.

Why locality matters: every edge whose ends lie in different partitions costs a halo row per
layer on the network, and every edge between chunks of one partition reads a stale history row.
So the partitioner keeps neighbours together, with balanced sizes (a rank's work is its nodes).

Methods (``data.graph_partitioner``):

- ``metis``: METIS through ``pymetis`` or ``pyg_lib`` when one is installed (the best cuts; sizes
  within METIS' default imbalance tolerance, a few percent, not exactly equal);
- ``bfs``: greedy graph growing in pure torch. Parts are grown one after another from a random
  seed: each step adds the unassigned nodes with the most edges into the growing part (gain
  ``2 * edges into the part - degree``, the change in cut edges), at most half the frontier and
  about 1/64 of the part at a time, so the work is some dozens of vectorised steps per part,
  not a loop over nodes. When the frontier is empty (the part's component is used up) it
  restarts from new random seeds, 1, 2, 4... of them (the rest of the graph is in pieces by
  then); nodes with no edges are added last, in bulk; the last part is what is left. Sizes are
  exact: ``N // parts`` or one more;
- ``index``: contiguous id ranges (for graphs whose ids already follow locality), exact sizes;
- ``auto``: ``metis`` when a binding is installed, else ``bfs``.

``chunk_nodes`` cuts each partition's induced subgraph the same way; chunk ``c`` of every
partition gets the global id ``c`` (they run at the same time, see ``veomni.data.graph.views``).
Edge direction is ignored: the partitioner sees each edge as undirected.
"""

from __future__ import annotations

import importlib.util

import torch

from veomni.errors import BadConfig

METHODS = ("auto", "metis", "bfs", "index")
GROWTH_STEPS = 64
"""A ``bfs`` part grows in about this many batches (more: slightly better cuts, slower)."""


def partition_nodes(edge_index: torch.Tensor, num_nodes: int, parts: int, method: str = "auto",
                    seed: int = 0) -> torch.Tensor:
    """Each node's partition in ``[0, parts)``, a LongTensor [num_nodes]."""
    if method not in METHODS:
        raise BadConfig(f"unknown graph partitioner {method!r}; data.graph_partitioner takes {', '.join(METHODS)}")
    if not 1 <= parts <= max(num_nodes, 1):
        raise BadConfig(f"cannot split {num_nodes} nodes into {parts} partitions: each partition needs a node "
                        "(use fewer data-parallel ranks or a larger graph)")
    if parts == 1:
        return torch.zeros(num_nodes, dtype=torch.long)
    if method == "index":
        return torch.arange(num_nodes) * parts // num_nodes
    rowptr, col = _undirected_csr(edge_index, num_nodes)
    if method == "metis" or (method == "auto" and metis_binding() is not None):
        return _metis(rowptr, col, parts)
    generator = torch.Generator().manual_seed(seed)
    return _grow(rowptr, col, _balanced_sizes(num_nodes, parts), generator)


def chunk_nodes(edge_index: torch.Tensor, part: torch.Tensor, parts: int, chunks: int, method: str = "auto",
                seed: int = 0) -> torch.Tensor:
    """Each node's chunk in ``[0, chunks)``: every partition's induced subgraph (the edges with both
    ends in it) cut into ``chunks`` pieces by ``method`` (seeded by ``seed`` and the partition)."""
    part = part.long()
    chunk = torch.zeros_like(part)
    if chunks == 1:
        return chunk
    src, dst = edge_index[0].long(), edge_index[1].long()
    inside = part[src] == part[dst]
    local = torch.full_like(part, -1)
    for p in range(parts):
        nodes = (part == p).nonzero().squeeze(1)
        if nodes.numel() == 0:
            continue
        local[nodes] = torch.arange(nodes.numel())
        keep = inside & (part[src] == p)
        sub = torch.stack([local[src[keep]], local[dst[keep]]])
        pieces = min(chunks, nodes.numel())  # a partition smaller than the chunk count leaves chunks empty
        chunk[nodes] = partition_nodes(sub, nodes.numel(), pieces, method, seed * 1_000_003 + p)
    return chunk


def edge_cut(edge_index: torch.Tensor, assignment: torch.Tensor) -> float:
    """The fraction of edges whose two ends lie in different parts (0 for no edges)."""
    if edge_index.shape[1] == 0:
        return 0.0
    return float((assignment[edge_index[0]] != assignment[edge_index[1]]).double().mean())


def metis_binding() -> str | None:
    """The installed METIS binding's module name (``pymetis`` or ``pyg_lib``), or None."""
    return next((name for name in ("pymetis", "pyg_lib") if importlib.util.find_spec(name) is not None), None)


def _metis(rowptr: torch.Tensor, col: torch.Tensor, parts: int) -> torch.Tensor:
    binding = metis_binding()
    if binding == "pymetis":
        import pymetis

        _, membership = pymetis.part_graph(parts, xadj=rowptr.numpy(), adjncy=col.numpy())
        return torch.as_tensor(membership, dtype=torch.long)
    if binding == "pyg_lib":
        import pyg_lib

        return pyg_lib.partition.metis(rowptr, col, parts).long()
    raise ImportError("data.graph_partitioner: metis needs a METIS binding, and neither pymetis nor pyg_lib is "
                      "installed: `pip install pymetis` (or pyg-lib from the PyG wheel index), or set "
                      "data.graph_partitioner: bfs (pure torch, locality-aware) or auto")


def _balanced_sizes(num_nodes: int, parts: int) -> list[int]:
    return [num_nodes // parts + (p < num_nodes % parts) for p in range(parts)]


def _undirected_csr(edge_index: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rowptr, col) of the graph with both directions of every edge, no self-loops, no duplicates."""
    src, dst = edge_index[0].long(), edge_index[1].long()
    keep = src != dst
    pairs = torch.cat([torch.stack([src[keep], dst[keep]]), torch.stack([dst[keep], src[keep]])], dim=1)
    key = torch.unique(pairs[0] * num_nodes + pairs[1])  # sorted: by source, then destination
    rowptr = torch.zeros(num_nodes + 1, dtype=torch.long)
    rowptr[1:] = torch.bincount(key // num_nodes, minlength=num_nodes).cumsum(0)
    return rowptr, key % num_nodes


def _neighbours(rowptr: torch.Tensor, col: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """The concatenated adjacency lists of ``nodes`` (one gather, no Python loop)."""
    start, count = rowptr[nodes], rowptr[nodes + 1] - rowptr[nodes]
    begins = torch.repeat_interleave(start - (count.cumsum(0) - count), count)
    return col[begins + torch.arange(begins.numel())]


def _grow(rowptr: torch.Tensor, col: torch.Tensor, sizes: list[int], generator: torch.Generator) -> torch.Tensor:
    """Greedy graph growing (the module docstring's ``bfs``)."""
    num_nodes = rowptr.numel() - 1
    degree = rowptr[1:] - rowptr[:-1]
    assignment = torch.full((num_nodes,), -1, dtype=torch.long)
    order = torch.randperm(num_nodes, generator=generator)
    seeds = order[degree[order] > 0]  # nodes with edges, in random order: where parts start
    isolated = order[degree[order] == 0]
    next_isolated = 0
    for p, size in enumerate(sizes[:-1]):
        into_part = torch.zeros(num_nodes, dtype=torch.long)  # edges from each node into part p
        step, filled, restarts = max(1, size // GROWTH_STEPS), 0, 0
        while filled < size:
            frontier = ((into_part > 0) & (assignment < 0)).nonzero().squeeze(1)
            if frontier.numel():
                gain = 2 * into_part[frontier] - degree[frontier]
                take = min(step, size - filled, max(1, frontier.numel() // 2))  # choosy: the better half at most
                add = frontier[torch.topk(gain, take).indices]
            else:
                seeds = seeds[assignment[seeds] < 0]
                if seeds.numel():  # 1, 2, 4... seeds: the remaining graph is in pieces, each restart finds less
                    add = seeds[:min(2 ** restarts, size - filled)]
                    restarts += 1
                else:  # only nodes without edges remain: they cut nothing wherever they go
                    add = isolated[next_isolated:next_isolated + size - filled]
                    next_isolated += add.numel()
            assignment[add] = p
            filled += add.numel()
            reached = _neighbours(rowptr, col, add)
            into_part.index_add_(0, reached, torch.ones_like(reached))
    assignment[assignment < 0] = len(sizes) - 1  # the last part is what is left
    return assignment
