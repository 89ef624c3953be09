"""Small graphs and their views for the graph-engine tests, with one-process references.

The graphs are random community graphs made here (labels follow communities, features are
noisy class centroids); partitions and chunks are simple fixed assignments, so these tests do not
depend on the partitioner. ``chunked_reference`` is the algorithm GNNPipe approximates, run in
one process: chunks in order, neighbours outside the chunk read from per-layer histories.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from models.gnn import GNNConfig, GNNModel
from veomni.data.graph.format import MANIFEST, TENSORS, GraphData, sha256
from veomni.data.graph.views import edge_weights, partition_views, split_labels
from veomni.parallel.graph.halo import apply_graph_parallel
from veomni.tasks import NodeClassificationTask


def community_graph(nodes: int = 48, classes: int = 3, features: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(classes, (nodes,), generator=g)
    same = y[:, None] == y[None, :]
    prob = torch.where(same, 0.25, 0.03)
    adj = torch.rand(nodes, nodes, generator=g) < prob
    adj = (adj | adj.T) & ~torch.eye(nodes, dtype=torch.bool)
    centroids = torch.randn(classes, features, generator=g)
    x = centroids[y] + 2.0 * torch.randn(nodes, features, generator=g)
    train = torch.rand(nodes, generator=g) < 0.6
    return {"x": x, "y": y, "edge_index": adj.nonzero().T.contiguous(), "train_mask": train}


def tiny_gnn(layer: str = "gcnii", layers: int = 4, seed: int = 0, graph: dict | None = None) -> GNNModel:
    graph = graph or community_graph()
    config = GNNConfig(layer=layer, in_features=graph["x"].shape[1], hidden_size=16,
                       num_classes=int(graph["y"].max()) + 1, num_layers=layers, dropout=0.0)
    torch.manual_seed(seed)
    model = GNNModel(config)
    model.init_weights()
    return model


def views(graph: dict, model: GNNModel, parts: int, rank: int, chunks: int,
          stale_gradients: bool = False) -> tuple[list[dict], dict]:
    """(chunk views, whole view) of partition ``rank``: node i in partition i % parts, chunk by
    position within its partition (contiguous thirds, etc.)."""
    n = graph["x"].shape[0]
    edge_index, weight = edge_weights(graph["edge_index"], n, model.config.neighbour_norm)
    part = torch.arange(n) % parts
    chunk = (torch.arange(n) // parts) * chunks // ((n + parts - 1) // parts)
    fields = {"x": graph["x"], "labels": split_labels(graph["y"], graph["train_mask"])}
    chunk_views, whole = partition_views(edge_index, weight, fields, part, parts, rank, chunk, chunks)
    for view in [*chunk_views, whole]:
        view["stale_gradients"] = torch.tensor(stale_gradients)
    return chunk_views, whole


def train_units(graph: dict) -> int:
    return int(graph["train_mask"].sum())


def reference_grads(model: GNNModel, graph: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss (mean over training nodes) and gradients of one process on the whole graph."""
    model = copy.deepcopy(model)
    _, whole = views(graph, model, 1, 0, 1)
    out = NodeClassificationTask()(model, whole)
    loss = out.loss_sum / train_units(graph)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def chunked_reference(model: GNNModel, graph: dict, chunks: int, epochs: int, lr: float = 0.1,
                      stale_gradients: bool = False) -> list[float]:
    """Per-epoch losses of chunked training with histories, one process, SGD after each epoch."""
    model = copy.deepcopy(model)
    apply_graph_parallel(model, model.parallel_plan(), None)
    chunk_views, _ = views(graph, model, 1, 0, chunks, stale_gradients)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        total = 0.0
        for view in chunk_views:
            loss = NodeClassificationTask()(model, view).loss_sum / train_units(graph)
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def named_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def write_raw(folder: Path, graph: GraphData) -> Path:
    """A graph folder written without ``save_graph``'s checks (how bad input reaches a run)."""
    folder.mkdir(parents=True)
    save_file(graph.tensors(), str(folder / TENSORS))
    manifest = {"format": "veomni-graph/1", "name": graph.name, "num_nodes": graph.num_nodes,
                "num_edges": graph.num_edges, "num_features": graph.num_features, "num_classes": graph.num_classes,
                "files": {TENSORS: {"bytes": (folder / TENSORS).stat().st_size, "sha256": sha256(folder / TENSORS)}}}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder
