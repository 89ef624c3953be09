"""Neighbour sampling: mini-batches of target nodes with sampled multi-hop neighbourhoods.

The standard recipe for graphs too large to train on whole (GraphSAGE, PyG's ``NeighborLoader``,
DGL's ``MultiLayerNeighborSampler``): each step takes a mini-batch of target nodes, samples up to
``fanouts[0]`` in-neighbours of each (hop 1, as PyG's ``num_neighbors[0]``), then up to
``fanouts[1]`` in-neighbours of every node reached so far, and so on; ``-1`` keeps the whole
neighbourhood. The result is one *block* (message-flow graph) per layer, input layer first: block
``l`` maps the ``block_sizes[l]`` source nodes to the ``block_sizes[l + 1]`` destination nodes,
destinations first among the sources (so a layer's own rows are a prefix of its input), and the
last block's destinations are the targets. ``veomni.ops.graph.BlockAggregation`` consumes them at
the layers' aggregation point.

Edge weights come from the whole graph's normalisation (``views.edge_weights``: GCN's symmetric
one uses full-graph degrees), scaled by ``degree / sampled`` per destination: an unbiased estimate
of the full-graph aggregate (for the mean, exactly the mean over the sampled neighbours). With
every fanout at -1 a mini-batch's targets get exactly their full-graph outputs and gradients.

Reproducible and resumable: the order of the targets is drawn per epoch, and the neighbours per
mini-batch, each from a generator seeded by (seed, stream, epoch[, index]); the state is (epoch,
position). ``stream`` keeps the draws of data-parallel ranks (each sampling around its own
partition's targets) apart; ``batches`` fixes the mini-batches per epoch, so that ranks whose
partitions hold different numbers of targets take the same number of steps: an epoch's targets are
split into ``batches`` parts whose sizes differ by at most one (``torch.tensor_split``).

``order``: ``random`` shuffles an epoch's targets; ``proximity`` puts them in breadth-first order
from a seeded root (BGL's proximity-aware order, ``veomni/data/graph/order.py``), so consecutive
mini-batches share neighbours and a feature cache hits more.

Features are read through ``fields["x"]``: a tensor, or a ``FeatureStore``
(``veomni/data/graph/features.py``) that serves rows from disk and counts what it read.

A sampler reads the graph as ``InEdges`` (each node's in-edges, sources and weights by
destination: ``in_edges``), which every sampler of a process can share: the run's training and
evaluation samplers hold one copy (``veomni.data.graph.source.sampled_graph``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from veomni.data.graph.features import FeatureStore
from veomni.data.graph.order import components, proximity_order, undirected
from veomni.errors import BadConfig

_MIX = 1_000_003


@dataclass(frozen=True)
class InEdges:
    """Every node's in-edges: ``source[start[v] : start[v] + degree[v]]`` and their ``weight``."""

    source: torch.Tensor
    weight: torch.Tensor
    degree: torch.Tensor
    start: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return self.degree.numel()


def in_edges(edge_index: torch.Tensor, edge_weight: torch.Tensor, num_nodes: int) -> InEdges:
    """``edge_index`` (source, destination) [2, E] and its weights as ``InEdges``."""
    src, dst = edge_index[0].long(), edge_index[1].long()
    by_destination = torch.argsort(dst, stable=True)
    degree = torch.bincount(dst, minlength=num_nodes)
    return InEdges(src[by_destination], edge_weight[by_destination].float(), degree, torch.cumsum(degree, 0) - degree)


def _generator(*keys: int) -> torch.Generator:
    seed = 0
    for key in keys:
        seed = (seed * _MIX + key) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


class NeighbourSampler:
    """Mini-batches of ``targets`` with their sampled blocks (see the module docstring).

    ``edges``: the whole graph's normalised edges (``in_edges``);
    ``fields``: per-node tensors [N, ...] gathered for the input nodes (``x``, also a
    ``FeatureStore``) or the targets (``labels`` and every other field). ``stream`` and
    ``batches``: see the module docstring (0 batches: ``ceil(targets / batch_size)``).
    """

    def __init__(self, edges: InEdges, targets: torch.Tensor, fields: dict[str, torch.Tensor | FeatureStore],
                 batch_size: int, fanouts: list[int], seed: int = 0, stream: int = 0, batches: int = 0,
                 order: str = "random", sequences: int = 1) -> None:
        if batch_size < 1:
            raise BadConfig(f"sampling batch_size is {batch_size}; give a positive number of target nodes")
        if order not in ("random", "proximity") or sequences < 1:
            raise BadConfig(f"sampling order {order!r} with {sequences} BFS sequence(s): random or proximity, "
                            "and at least one sequence")
        if not fanouts or any(f == 0 or f < -1 for f in fanouts):
            raise BadConfig(f"sampling fanouts {fanouts}: give one per message-passing layer, each a positive "
                            "number of neighbours or -1 for all of them")
        self.source, self.weight, self.degree, self.start = edges.source, edges.weight, edges.degree, edges.start
        self.num_nodes, self.targets, self.fields = edges.num_nodes, targets.long(), fields
        self.batch_size, self.fanouts, self.seed, self.stream = batch_size, list(fanouts), seed, stream
        self.batches = batches or -(-self.targets.numel() // batch_size)
        self.order, self.sequences = order, sequences
        self._neighbours: tuple[torch.Tensor, ...] = ()  # (source, start, degree, component), made once
        self.epoch, self.position = 0, 0
        self._split: tuple[int, list[torch.Tensor]] = (-1, [])

    def __len__(self) -> int:
        return self.batches

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """The rest of this epoch's mini-batches, from the saved position; then the next epoch."""
        while self.position < len(self):
            index = self.position
            self.position += 1
            yield self.batch_at(self.epoch, index)
        self.epoch, self.position = self.epoch + 1, 0

    def epoch_targets(self, epoch: int) -> list[torch.Tensor]:
        """The targets of each mini-batch of ``epoch``, in order: a seeded permutation, split."""
        if self._split[0] == epoch:
            return self._split[1]
        generator = _generator(self.seed, self.stream, epoch)
        if self.order == "proximity":
            if not self._neighbours:
                source, start, degree = undirected(self.source, self.degree)
                self._neighbours = (source, start, degree, components(source, degree))
            order = proximity_order(*self._neighbours[:3], self.targets, self.sequences, generator,
                                    self._neighbours[3])
        else:
            order = self.targets[torch.randperm(self.targets.numel(), generator=generator)]
        self._split = (epoch, list(torch.tensor_split(order, self.batches)))
        return self._split[1]

    def batch_at(self, epoch: int, index: int) -> dict[str, torch.Tensor]:
        """Mini-batch ``index`` of ``epoch``: a function of (seed, stream, epoch, index) only."""
        targets = self.epoch_targets(epoch)[index]
        return self.mini_batch(targets, _generator(self.seed, self.stream, epoch, index + 1))

    def mini_batch(self, targets: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The blocks around ``targets`` and the fields the model and the loss read."""
        nodes, blocks = targets, []
        for fanout in self.fanouts:
            nodes, edge_index, edge_weight = self._hop(nodes, fanout, generator)
            blocks.append((nodes.numel(), edge_index, edge_weight))
        blocks.reverse()
        batch = {name: _rows(value, nodes if name == "x" else targets) for name, value in self.fields.items()}
        batch.update(nodes=nodes, targets=targets,
                     block_sizes=torch.tensor([size for size, _, _ in blocks] + [targets.numel()]))
        for layer, (_, edge_index, edge_weight) in enumerate(blocks):
            batch[f"block{layer}_edge_index"], batch[f"block{layer}_edge_weight"] = edge_index, edge_weight
        return batch

    def _hop(self, dst: torch.Tensor, fanout: int,
             generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(source nodes, destinations first; local edges; weights) of one block into ``dst``."""
        degree = self.degree[dst]
        owner = torch.repeat_interleave(torch.arange(dst.numel()), degree)
        rank = torch.arange(owner.numel()) - torch.repeat_interleave(torch.cumsum(degree, 0) - degree, degree)
        edge = self.start[dst][owner] + rank
        taken = degree
        if fanout != -1:
            # a random order within each destination's in-edges, then its first `fanout` of them
            shuffled = torch.argsort(torch.rand(edge.numel(), generator=generator))
            shuffled = shuffled[torch.argsort(owner[shuffled], stable=True)]
            keep = rank < fanout  # rank is the position within the destination's run, unchanged by the shuffle
            edge, owner = edge[shuffled][keep], owner[keep]
            taken = degree.clamp(max=fanout)
        source = self.source[edge]
        new = torch.unique(source)
        seen = torch.zeros(self.num_nodes, dtype=torch.bool)
        seen[dst] = True
        nodes = torch.cat([dst, new[~seen[new]]])
        local = torch.full((self.num_nodes,), -1, dtype=torch.long)
        local[nodes] = torch.arange(nodes.numel())
        scale = degree.double() / taken.clamp(min=1).double()
        weight = (self.weight[edge].double() * scale[owner]).float()
        return nodes, torch.stack([local[source], owner]), weight


def _rows(field: torch.Tensor | FeatureStore, nodes: torch.Tensor) -> torch.Tensor:
    return field.gather(nodes) if isinstance(field, FeatureStore) else field[nodes]
