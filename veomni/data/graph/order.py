"""BGL's proximity-aware mini-batch order: targets in breadth-first order, so consecutive
mini-batches hold nearby nodes and share much of their sampled neighbourhoods, and a feature
cache of recent rows serves them (BGL, Liu et al. NSDI 2023, section 4.1).

One sequence is a BFS over the graph's edges taken either way (``undirected``: neighbours in
ascending id order) from a seeded random permutation of the nodes: the first node of the
permutation is the root, and when a component is exhausted the BFS restarts at the next
unvisited node of the permutation; each level is in order of discovery. ``bfs_visit`` computes
exactly that queue BFS without a Python step per component or per node: the components first
(``components``: min-label hooking with pointer jumping, a few passes over the edges), then one
level-synchronous BFS from every component's root at once (a Python step per level of the deepest
component), the nodes finally sorted by (their component's root's place in the permutation, visit
index).

BGL mixes randomness into the order (a single BFS makes every mini-batch a tight ball, whose
gradients are correlated: on a graph of class-pure communities, one class at a time). With
``sequences`` > 1 the BFS starts from more roots at once: the first ``sequences`` nodes of the
permutation as well as each component's root, all expanding level by level together (a node
reached at the same level by several goes to the one whose root comes first in the permutation);
the i-th root leads sequence i mod ``sequences``. ``proximity_order`` interleaves the sequences
round-robin over the targets (the first target of every sequence, then the second...), so a
mini-batch holds a stretch of each sequence, and the next one the following stretches. One BFS
pass, whatever the number of sequences. A new draw every epoch keeps the order from repeating.
"""

from __future__ import annotations

import torch

from veomni.data.graph.views import unique_columns


def destinations(degree: torch.Tensor) -> torch.Tensor:
    """The destination of every in-edge of the CSR (``source`` sorted by destination)."""
    return torch.repeat_interleave(torch.arange(degree.numel()), degree)


def undirected(source: torch.Tensor, degree: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(source, start, degree) of the CSR of every node's neighbours either way, each once and in
    ascending order: proximity does not care which way an edge points."""
    num_nodes = degree.numel()
    destination = destinations(degree)
    pairs = unique_columns(torch.stack([torch.cat([destination, source]), torch.cat([source, destination])]), num_nodes)
    degree = torch.bincount(pairs[0], minlength=num_nodes)
    return pairs[1].clone(), torch.cumsum(degree, 0) - degree, degree  # a row of its own: the pairs are freed


def components(source: torch.Tensor, degree: torch.Tensor) -> torch.Tensor:
    """Each node's component [N], named by its smallest node id (min-label hooking, pointer jumping)."""
    destination = destinations(degree)
    label = torch.arange(degree.numel())
    while True:
        root_a, root_b = label[source], label[destination]
        low = torch.minimum(root_a, root_b)
        hooked = label.clone()
        hooked.scatter_reduce_(0, root_a, low, reduce="amin")  # each root to the smallest root it touches
        hooked.scatter_reduce_(0, root_b, low, reduce="amin")
        while True:  # every node straight to its root
            jumped = hooked[hooked]
            if torch.equal(jumped, hooked):
                break
            hooked = jumped
        if torch.equal(hooked, label):
            return label
        label = hooked


def bfs_visit(source: torch.Tensor, start: torch.Tensor, degree: torch.Tensor, generator: torch.Generator,
              sequences: int = 1, component: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank, sequence), each [N]: the node's place in the BFS order and the BFS sequence that
    reached it (module docstring). The CSR is symmetric (``undirected``: the neighbours of node v at
    ``source[start[v]:start[v] + degree[v]]``); the roots come from a permutation drawn from
    ``generator``. ``component``: ``components(source, degree)``, if known."""
    num_nodes = degree.numel()
    component = components(source, degree) if component is None else component
    place = torch.empty(num_nodes, dtype=torch.long)
    place[torch.randperm(num_nodes, generator=generator)] = torch.arange(num_nodes)
    component_root = torch.full((num_nodes,), num_nodes, dtype=torch.long).scatter_reduce_(
        0, component, place, reduce="amin")[component]  # the place of each node's component's root
    frontier = ((place == component_root) | (place < sequences)).nonzero()[:, 0]
    frontier = frontier[torch.argsort(place[frontier])]
    owner = torch.full((num_nodes,), -1, dtype=torch.long)  # the root whose sequence reached the node
    owner[frontier] = frontier
    sequence = torch.full((num_nodes,), -1, dtype=torch.long)
    sequence[frontier] = torch.arange(frontier.numel()) % sequences
    visit = torch.full((num_nodes,), -1, dtype=torch.long)
    visit[frontier] = torch.arange(frontier.numel())
    visited = frontier.numel()
    while frontier.numel():
        counts = degree[frontier]
        by = torch.repeat_interleave(torch.arange(frontier.numel()), counts)
        offset = torch.arange(by.numel()) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        reached = source[start[frontier][by] + offset]
        fresh = visit[reached] < 0
        reached, by = reached[fresh], frontier[by[fresh]]
        nodes, inverse = torch.unique(reached, return_inverse=True)
        first = torch.full((nodes.numel(),), reached.numel(), dtype=torch.long)
        first.scatter_reduce_(0, inverse, torch.arange(reached.numel()), reduce="amin")
        first = first.sort().values  # order of discovery; the first to reach a node takes it
        frontier = reached[first]
        owner[frontier], sequence[frontier] = owner[by[first]], sequence[by[first]]
        visit[frontier] = torch.arange(visited, visited + frontier.numel())
        visited += frontier.numel()
    by_visit = torch.argsort(visit)
    order = by_visit[torch.argsort(place[owner[by_visit]], stable=True)]
    rank = torch.empty(num_nodes, dtype=torch.long)
    rank[order] = torch.arange(num_nodes)
    return rank, sequence


def proximity_order(source: torch.Tensor, start: torch.Tensor, degree: torch.Tensor, targets: torch.Tensor,
                    sequences: int, generator: torch.Generator, component: torch.Tensor | None = None) -> torch.Tensor:
    """``targets`` in BGL's order: the BFS of ``bfs_visit`` with ``sequences`` sequences, each
    sequence's targets in BFS order, interleaved round-robin (module docstring)."""
    rank, sequence = bfs_visit(source, start, degree, generator, sequences, component)
    ordered = targets[torch.argsort(rank[targets])]
    of = sequence[ordered]
    counts = torch.bincount(of, minlength=sequences)
    position = torch.empty_like(ordered)
    position[torch.argsort(of, stable=True)] = (torch.arange(ordered.numel())
                                                - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts))
    return ordered[torch.argsort(position * sequences + of)]
