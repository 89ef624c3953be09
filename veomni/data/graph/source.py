"""The graph a run reads, shared by both graph datasets (full-graph views, ``dataset.py``, and
sampled mini-batches, ``sampled.py``): loaded, checked, normalised and partitioned once per
process, and the checks a launch runs on the recipe and the folder before any worker starts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from veomni.config.schema import DataConfig
from veomni.contract.graph_model import GraphModelConfig
from veomni.data.graph.format import GraphData, check_graph, load_graph, read_manifest
from veomni.data.graph.partition import chunk_nodes, metis_binding, partition_nodes
from veomni.data.graph.sampling import InEdges, in_edges
from veomni.data.graph.views import edge_weights
from veomni.errors import BadConfig, BadData


@functools.lru_cache(maxsize=1)
def prepared_graph(folder: str, sha256: str, norm: str, method: str, parts: int, chunks: int, seed: int,
                   map_features: bool = False) -> tuple[GraphData, torch.Tensor, torch.Tensor, torch.Tensor,
                                                        torch.Tensor]:
    """(graph, normalised edges, their weights, each node's partition, each node's chunk);
    ``map_features``: ``graph.x`` memory-mapped (its check reads it once through the page cache)."""
    graph = load_graph(folder, map_features)
    problems = check_graph(graph)
    if problems:
        raise BadData("the graph cannot be trained on: " + "; ".join(problems))
    edges, weights = edge_weights(graph.edge_index, graph.num_nodes, norm, graph.edge_weight)
    part = partition_nodes(graph.edge_index, graph.num_nodes, parts, method, seed)
    chunk = chunk_nodes(graph.edge_index, part, parts, chunks, method, seed)
    return graph, edges, weights, part, chunk


@functools.lru_cache(maxsize=1)
def sampled_graph(folder: str, sha256: str, norm: str, method: str, parts: int, seed: int,
                  map_features: bool = False) -> tuple[GraphData, InEdges, torch.Tensor]:
    """(graph, its normalised in-edges, each node's partition) for samplers: the graph (features,
    labels, splits) without its edge list, which the in-edges replace; loaded, checked and
    normalised as ``prepared_graph`` does, and kept once however many samplers read it."""
    graph, edges, weights, part, _ = prepared_graph.__wrapped__(folder, sha256, norm, method, parts, 1, seed,
                                                                map_features)
    kept = dataclasses.replace(graph, edge_index=graph.edge_index.new_empty(2, 0), edge_weight=None)  # no view: freed
    return kept, in_edges(edges, weights, graph.num_nodes), part


def config_problems(cfg: DataConfig, model_config: Any) -> list[str]:
    """What the recipe gets wrong before any graph is read."""
    problems = []
    if not isinstance(model_config, GraphModelConfig):
        problems.append(f"data.kind graph feeds models whose config has in_features, num_classes and "
                        f"neighbour_norm (veomni.ops.graph.GraphModelConfig); {type(model_config).__name__} "
                        "does not: pick a graph model (model.arch) or another data.kind")
    if cfg.num_workers:
        problems.append(f"data.num_workers={cfg.num_workers}: the graph kind keeps the whole graph in the "
                        "training process and yields precomputed views; set data.num_workers: 0")
    if cfg.graph_partitioner == "metis" and metis_binding() is None:
        problems.append("data.graph_partitioner: metis needs pymetis or pyg_lib installed (`pip install pymetis`); "
                        "or use bfs / auto")
    return problems + sampling_problems(cfg)


def sampling_problems(cfg: DataConfig) -> list[str]:
    """The sampled mini-batch options (``data.graph_fanouts`` and the keys that go with it)."""
    problems = []
    bad = [f for f in cfg.graph_fanouts if f == 0 or f < -1]
    if bad:
        problems.append(f"data.graph_fanouts={cfg.graph_fanouts}: each entry is the neighbours sampled per node at "
                        f"one hop (a positive number, or -1 for all of them), not {bad[0]}")
    if cfg.graph_fanouts and cfg.graph_batch_size < 1:
        problems.append(f"data.graph_batch_size={cfg.graph_batch_size}: give the target nodes per mini-batch, >= 1")
    if cfg.graph_prefetch < 0:
        problems.append(f"data.graph_prefetch={cfg.graph_prefetch}: mini-batches made ahead, >= 0 (0: in the step)")
    if cfg.graph_cache_rows < 0:
        problems.append(f"data.graph_cache_rows={cfg.graph_cache_rows}: feature rows to cache, >= 0 (0: no cache)")
    if cfg.graph_order_sequences < 1:
        problems.append(f"data.graph_order_sequences={cfg.graph_order_sequences}: BFS sequences interleaved by the "
                        "proximity order, >= 1")
    return problems


def model_problems(path: str, manifest: dict[str, Any], model_config: GraphModelConfig) -> list[str]:
    """The model's input and output sizes against the graph's manifest."""
    problems = []
    if model_config.in_features != manifest["num_features"]:
        problems.append(f"model.in_features={model_config.in_features}, but the graph {path} has "
                        f"{manifest['num_features']} features per node; set model.in_features: "
                        f"{manifest['num_features']}")
    if model_config.num_classes != manifest["num_classes"]:
        problems.append(f"model.num_classes={model_config.num_classes}, but the graph {path} has "
                        f"{manifest['num_classes']} classes; set model.num_classes: {manifest['num_classes']}")
    return problems


def checked_manifest(cfg: DataConfig, path: str, model_config: GraphModelConfig) -> dict[str, Any]:
    """A dataset's own check of the recipe and of the folder it reads (the worker side of
    ``check_graph_data``): the folder's manifest, or BadConfig / BadData naming every problem."""
    problems = config_problems(cfg, model_config)
    if problems:
        raise BadConfig("; ".join(problems))
    manifest = read_manifest(path)
    problems = model_problems(path, manifest, model_config)
    if problems:
        raise BadData("; ".join(problems))
    return manifest


def check_graph_data(cfg: DataConfig, model_config: Any) -> list[str]:
    """The launcher's pre-flight: the recipe, then each graph folder read and checked whole (its
    checksum, edges, masks, features, labels), so bad input fails before any worker starts."""
    problems = config_problems(cfg, model_config)
    if problems:
        return problems
    for key, path in (("data.train_path", cfg.train_path), ("data.eval_path", cfg.eval_path)):
        if not path or (key == "data.eval_path" and path == cfg.train_path):
            continue
        try:
            graph = load_graph(path)
        except ValueError as exc:
            problems.append(f"{key}: {exc}")
            continue
        problems += [f"{key}: {p}" for p in check_graph(graph) + model_problems(path, graph.manifest, model_config)]
    return problems
