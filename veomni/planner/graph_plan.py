"""``--dry-run`` lines for graph models: the graph, the history memory per rank, and the bytes
an epoch sends under graph parallelism, GNNPipe and their hybrid.

The graph's size comes from its manifest when the folder exists (``veomni/data/graph/format.py``); before it
is built, from the recipe: ``data.tokens_per_micro_batch`` nodes per chunk (the micro-batch
budget in the task's unit) x ``train.grad_accum`` chunks x data-parallel partitions, and the
model's ``avg_degree``.

The formulas (P partitions, K stages, L message-passing layers, N nodes, halo H rows per
partition, history width d, stage width w, 4-byte elements):

- history per rank (chunked runs only): its L / K layers x (N / P + H) rows x d (counted in the
  memory totals), three such tables with ``data.graph_stale_gradients`` (the gradients collected
  this epoch and those due from the last);
- graph parallelism: every layer sends each halo row forward and its gradient back, so each
  partition sends about 2 L H d elements an epoch (symmetric graphs: it sends as many rows
  as it receives);
- GNNPipe: each of the K - 1 stage boundaries carries every node's state forward and its
  gradient back: 2 (K - 1) N w, whatever the depth;
- the hybrid: both, each stage exchanging halos for its own L / K layers.

H is estimated for a random partition, ``N (1 - 1/P) (1 - (1 - 1/P)^D)``: a node is a halo row of a
partition when one of its D neighbours lives there. A locality-aware partition (METIS, BFS) cuts
it, so the graph-parallel figure is an upper estimate; the training metrics report the bytes
measured (``comm_bytes_graph_halo``, ``comm_bytes_pp_p2p``).

Sampled mini-batch training (``data.graph_fanouts``) has none of these: its lines come from
``veomni/planner/sampled_plan.py`` (memory per rank, feature bytes per epoch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from veomni.config.schema import RunConfig
from veomni.contract.graph_model import GraphCost, GraphModelConfig
from veomni.data.graph.format import GraphFormatError, read_manifest
from veomni.parallel.mesh import ParallelDims
from veomni.planner.sampled_plan import sampled_plan_lines

GiB = 2**30


@dataclass(frozen=True)
class GraphSize:
    nodes: int
    edges: int
    source: str
    features: int = 0
    """From the manifest; 0 before the graph is built."""
    labelled_nodes: int | None = None
    """From the manifest's builder stats, when it has them."""


def graph_size(cfg: RunConfig, dims: ParallelDims, avg_degree: float) -> GraphSize:
    try:
        meta = read_manifest(cfg.data.train_path or ".")
        train = meta.get("stats", {}).get("labelled_nodes")
        return GraphSize(int(meta["num_nodes"]), int(meta["num_edges"]), f"{cfg.data.train_path}/manifest.json",
                         int(meta.get("num_features", 0)), int(train) if train is not None else None)
    except GraphFormatError:  # not built yet (or not a graph folder: the launcher's data check says so)
        pass
    nodes = cfg.data.tokens_per_micro_batch * cfg.train.grad_accum * dims.dp_size
    return GraphSize(nodes, int(nodes * avg_degree), "the recipe (data.tokens_per_micro_batch x train.grad_accum "
                     "x dp ranks; the model's assumed degree)")


def halo_rows(nodes: int, edges: int, parts: int) -> float:
    if parts == 1:
        return 0.0
    degree = edges / nodes
    return nodes * (1 - 1 / parts) * (1 - (1 - 1 / parts) ** degree)


@dataclass(frozen=True)
class GraphPlan:
    lines: list[str]
    history_gb: float
    """The history tables of the rank with the most layers (0 with one chunk)."""
    exact_activations_gb: float
    """Activations an exact epoch (whole partition, one chunk) keeps on that rank."""


def graph_plan(cfg: RunConfig, dims: ParallelDims, model: nn.Module, cost: GraphCost,
               activation_bytes_per_node: float, model_config: Any = None) -> GraphPlan:
    size = graph_size(cfg, dims, cost.assumed_degree(model))
    if cfg.data.graph_fanouts:  # sampled mini-batches: no histories, no halo exchange, no pipeline
        features = size.features or (model_config.in_features if isinstance(model_config, GraphModelConfig) else 0)
        lines = [f"graph         {size.nodes:,} nodes, {size.edges:,} edges (from {size.source})",
                 *sampled_plan_lines(cfg, dims.dp_size, size.nodes, size.edges, features, size.labelled_nodes,
                                     activation_bytes_per_node)]
        return GraphPlan(lines, 0.0, 0.0)
    parts, stages, chunks = dims.dp_size, dims.pp, cfg.train.grad_accum
    layers, d, w = cost.aggregations(model), cost.history_width(model), cost.stage_width(model)
    stage_layers = math.ceil(layers / stages)  # graph models split layers evenly
    halo = halo_rows(size.nodes, size.edges, parts)
    tables = 3 if cfg.data.graph_stale_gradients else 1  # the history, plus collected and due gradients
    history = tables * stage_layers * (size.nodes / parts + halo) * d * 4 if chunks > 1 else 0.0
    exact_activations = activation_bytes_per_node * size.nodes / parts * stage_layers / layers
    halo_bytes = 2 * layers * halo * d * 4 * parts
    pipe_bytes = 2 * (stages - 1) * size.nodes * w * 4

    def gb(value: float) -> str:
        return f"{value / GiB:.3f} GiB"

    mode = ("single process" if parts == stages == 1 else "graph parallelism" if stages == 1
            else "GNNPipe" if parts == 1 else "hybrid GNNPipe x graph parallelism")
    lines = [
        f"graph         {size.nodes:,} nodes, {size.edges:,} edges (from {size.source})",
        f"graph plan    {mode}: {parts} partition(s) x {stages} stage(s), {chunks} chunk(s) per epoch; "
        f"halo ~{halo:,.0f} rows per partition (random-partition estimate)",
        f"history       {gb(history)} per rank" + (" (one chunk: none kept)" if chunks == 1 else
                                                   f" ({tables} table(s) x {stage_layers} layers x "
                                                   f"{size.nodes // parts:,} + halo rows x {d}; in the memory "
                                                   "totals below)"),
        f"exact epochs  {gb(exact_activations)} of activations per rank: warm-up, refresh and eval epochs run the "
        "whole partition as one chunk (the table counts one chunk)",
        "bytes / epoch (all ranks; measured ones land in metrics as comm_bytes_*):",
        f"  graph parallelism ({parts} partitions)       {gb(halo_bytes) if parts > 1 else '0 (one partition)'}",
        f"  GNNPipe ({stages} stages, state width {w})    {gb(pipe_bytes) if stages > 1 else '0 (one stage)'}",
    ]
    if parts > 1 and stages > 1:
        lines.append(f"  this hybrid                              {gb(halo_bytes + pipe_bytes)}")
    if stages > 1 or parts > 1:
        alt_parts = max(parts * stages, 2)
        alt_halo = 2 * layers * halo_rows(size.nodes, size.edges, alt_parts) * d * 4 * alt_parts
        alt_pipe = 2 * (alt_parts - 1) * size.nodes * w * 4
        lines.append(f"  on {alt_parts} ranks: graph parallelism {gb(alt_halo)} vs GNNPipe {gb(alt_pipe)} "
                     f"(ratio {alt_halo / max(alt_pipe, 1):.1f}x)")
    return GraphPlan(lines, history / GiB, exact_activations / GiB)
