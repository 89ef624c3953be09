"""BGL's proximity-aware mini-batch order: targets in breadth-first order, so consecutive
mini-batches hold nearby nodes and share much of their sampled neighbourhoods, and a feature
cache of recent rows serves them (BGL, Liu et al. NSDI 2023, section 4.1).

Each epoch runs one BFS over the in-edges (an undirected graph stores both directions) from a
seeded random root, restarting from a random unvisited node when a component is exhausted, with
each level in order of discovery; the targets are sorted by their visit rank and cut into
consecutive mini-batches. A new root every epoch keeps the order from repeating.
"""

from __future__ import annotations

import torch


def bfs_ranks(source: torch.Tensor, start: torch.Tensor, degree: torch.Tensor,
              generator: torch.Generator) -> torch.Tensor:
    """Each node's visit rank [N] in a BFS over in-edges (``source`` sorted by destination, the
    run of node v at ``start[v]`` of length ``degree[v]``), roots drawn from ``generator``."""
    num_nodes = degree.numel()
    rank = torch.full((num_nodes,), -1, dtype=torch.long)
    roots = torch.randperm(num_nodes, generator=generator)
    visited, next_root = 0, 0
    frontier = torch.empty(0, dtype=torch.long)
    while visited < num_nodes:
        if frontier.numel() == 0:
            while rank[roots[next_root]] >= 0:
                next_root += 1
            frontier = roots[next_root:next_root + 1]
            rank[frontier] = visited
            visited += 1
        counts = degree[frontier]
        owner = torch.repeat_interleave(torch.arange(frontier.numel()), counts)
        offset = torch.arange(owner.numel()) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        reached = source[start[frontier][owner] + offset]
        reached = reached[rank[reached] < 0]
        if reached.numel() == 0:
            frontier = reached
            continue
        nodes, inverse = torch.unique(reached, return_inverse=True)
        first = torch.full((nodes.numel(),), reached.numel(), dtype=torch.long)
        first.scatter_reduce_(0, inverse, torch.arange(reached.numel()), reduce="amin")
        frontier = nodes[torch.argsort(first)]  # order of discovery
        rank[frontier] = torch.arange(visited, visited + frontier.numel())
        visited += frontier.numel()
    return rank
