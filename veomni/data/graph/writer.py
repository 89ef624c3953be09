"""One call from a user's own graph to a graph folder the ``graph`` dataset kind trains on.

Why: the folder's manifest holds per-file sizes and checksums that nobody should write by hand,
and a graph usually lives in arrays, a ``networkx`` graph or a ``torch_geometric`` ``Data``
already. ``write_graph_folder`` takes any of them, fills in what is left out (both directions of
an undirected graph's edges, a seeded train/val/test split of the labelled nodes), checks the
result with the format's own checks and writes it with ``graph_format.save_graph`` (atomically,
manifest included). Duplicate edges are kept here and merged when the graph is read
(``graph_views.edge_weights`` sums their weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from veomni.data.graph.format import MASKS, UNLABELLED, GraphData, GraphFormatError, save_graph

NX_FEATURES = "x"
NX_LABEL = "y"
NX_WEIGHT = "weight"
"""Attribute names read from a ``networkx`` graph's nodes (features, label) and edges (weight)."""


def write_graph_folder(folder: str | Path, graph: Any = None, *, x: Any = None, y: Any = None,
                       edge_index: Any = None, edge_weight: Any = None, num_classes: int | None = None,
                       masks: dict[str, Any] | None = None, split: Sequence[float] = (0.6, 0.2, 0.2),
                       undirected: bool = True, seed: int = 0, name: str = "graph", description: str = "",
                       class_names: list[str] | None = None) -> Path:
    """Write a graph folder from ``graph`` (a ``networkx`` graph whose nodes carry ``x`` and ``y``
    and whose edges may carry ``weight``, or a ``torch_geometric`` ``Data``), or from arrays:
    ``x`` [N, F] features, ``y`` [N] labels (-1: unlabelled), ``edge_index`` [2, E] (source,
    destination), ``edge_weight`` [E] (optional, > 0). ``masks``: ``train_mask`` / ``val_mask`` /
    ``test_mask`` [N] booleans; without them the labelled nodes are split by ``split`` fractions
    (seeded). ``undirected``: add the reverse of every edge. Raises ``GraphFormatError`` listing
    every problem (nothing is written then)."""
    if graph is not None:
        x, y, edge_index, edge_weight, masks = _from_graph(graph, masks)
    if x is None or y is None or edge_index is None:
        raise GraphFormatError("write_graph_folder needs a graph, or x, y and edge_index")
    x = torch.as_tensor(x, dtype=torch.float32)
    y = torch.as_tensor(y, dtype=torch.int64)
    edge_index = torch.as_tensor(edge_index, dtype=torch.int64).reshape(2, -1)
    weight = None if edge_weight is None else torch.as_tensor(edge_weight, dtype=torch.float32).reshape(-1)
    if undirected:
        edge_index = torch.cat([edge_index, edge_index.flip(0)], dim=1)
        weight = None if weight is None else torch.cat([weight, weight])
    split_masks = _masks(y, masks, split, seed)
    classes = num_classes if num_classes is not None else int(y.max()) + 1 if y.numel() else 0
    return save_graph(folder, GraphData(x=x, y=y, edge_index=edge_index, **split_masks, num_classes=classes,
                                        name=name, description=description, source="write_graph_folder",
                                        class_names=class_names, edge_weight=weight))


def _from_graph(graph: Any, masks: dict[str, Any] | None) -> tuple[Any, Any, Any, Any, dict[str, Any] | None]:
    """(x, y, edge_index, edge_weight, masks) of a ``torch_geometric`` ``Data`` or a ``networkx`` graph."""
    if hasattr(graph, "edge_index") and hasattr(graph, "x"):  # torch_geometric.data.Data, without importing it
        found = {mask: getattr(graph, mask) for mask in MASKS if getattr(graph, mask, None) is not None}
        return graph.x, graph.y, graph.edge_index, getattr(graph, "edge_weight", None), masks or found or None
    if not hasattr(graph, "nodes") or not hasattr(graph, "edges"):
        raise GraphFormatError(f"write_graph_folder takes a networkx graph or a torch_geometric Data, "
                               f"not {type(graph).__name__}")
    nodes = list(graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    missing = [node for node in nodes if NX_FEATURES not in graph.nodes[node]][:3]
    if missing:
        raise GraphFormatError(f"networkx nodes {missing} have no {NX_FEATURES!r} attribute (their features)")
    x = [list(map(float, graph.nodes[node][NX_FEATURES])) for node in nodes]
    y = [int(graph.nodes[node].get(NX_LABEL, UNLABELLED)) for node in nodes]
    edges = list(graph.edges(data=True))
    edge_index = [[index[a] for a, _, _ in edges], [index[b] for _, b, _ in edges]]
    weighted = any(NX_WEIGHT in data for _, _, data in edges)
    weight = [float(data.get(NX_WEIGHT, 1.0)) for _, _, data in edges] if weighted else None
    if masks is None and all(mask in graph.nodes[node] for node in nodes for mask in MASKS):
        masks = {mask: [bool(graph.nodes[node][mask]) for node in nodes] for mask in MASKS}
    return x, y, edge_index, weight, masks


def _masks(y: torch.Tensor, masks: dict[str, Any] | None, split: Sequence[float], seed: int) -> dict[str, torch.Tensor]:
    """The given masks, or the labelled nodes split by the ``split`` fractions in a seeded order."""
    if masks is not None:
        unknown = sorted(set(masks) - set(MASKS))
        if unknown:
            raise GraphFormatError(f"masks {unknown} are not one of {MASKS}")
        return {mask: torch.as_tensor(masks.get(mask, [False] * len(y)), dtype=torch.bool) for mask in MASKS}
    if len(split) != 3 or any(f < 0 for f in split) or sum(split) > 1 + 1e-9:
        raise GraphFormatError(f"split {tuple(split)} must be three fractions (train, val, test) >= 0 summing to <= 1")
    labelled = (y != UNLABELLED).nonzero().squeeze(1)
    order = labelled[torch.randperm(labelled.numel(), generator=torch.Generator().manual_seed(seed))]
    ends = torch.tensor([0.0, split[0], split[0] + split[1], sum(split)]).mul(order.numel()).round().long()
    out = {}
    for mask, start, end in zip(MASKS, ends[:-1].tolist(), ends[1:].tolist()):
        out[mask] = torch.zeros(len(y), dtype=torch.bool)
        out[mask][order[start:end]] = True
    return out
