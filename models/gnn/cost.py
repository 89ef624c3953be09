"""Cost model of the GNN stack: FLOPs by node and edge counts, activation and history memory.

Units are nodes (the node-classification task's units of work). Per layer of width d over a
view of n target nodes and E in-edges: the aggregation does 2 E d FLOPs (a multiply-add per
edge and feature) and the transform 2 n d^2 per linear map (SAGE has two, GCN and GCNII one);
the embedding adds 2 n F d and the head 2 n d C. Training costs three times the forward.

The edges counted are a view's fresh and stale ones together, so the chunks of an epoch add up
to the full-graph layer's work whatever the chunking: these are model FLOPs of the exact layer
(stale rows come from the history and get no gradient, so a chunked run actually does a little
less backward work than counted). ``--dry-run`` has no graph, so it assumes ``avg_degree``
in-edges per node (the config field; self-loop included).

A sampled mini-batch (``block_sizes``) is counted block by block: layer l aggregates its block's
edges and transforms its ``block_sizes[l + 1]`` targets; the embedding runs on every input node,
the head on the targets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from .config import GNNConfig

TRANSFORMS = {"gcn": 1, "sage": 2, "gcnii": 1}
"""d x d linear maps each layer applies per target node."""
SAVED_PER_LAYER = {"gcn": 2, "sage": 3, "gcnii": 2}
"""Hidden-wide rows a layer keeps for backward per node: the aggregate (the weight's input), the
ReLU output, and for SAGE the root input of ``lin_r``."""


def forward_flops(config: GNNConfig, nodes: float, edges: float) -> float:
    d = config.hidden_size
    layer = 2 * edges * d + TRANSFORMS[config.layer] * 2 * nodes * d * d
    return 2 * nodes * d * (config.in_features + config.num_classes) + config.num_layers * layer


def block_flops(config: GNNConfig, batch: Mapping[str, Any]) -> float:
    """Forward FLOPs of a sampled mini-batch (module docstring)."""
    d, sizes = config.hidden_size, [int(n) for n in batch["block_sizes"]]
    layers = sum(2 * batch[f"block{i}_edge_index"].shape[1] * d + TRANSFORMS[config.layer] * 2 * sizes[i + 1] * d * d
                 for i in range(len(sizes) - 1))
    return 2 * d * (sizes[0] * config.in_features + sizes[-1] * config.num_classes) + layers


class GNNCost:
    """The engine's ``CostModel`` (and ``GraphCost``) for ``GNNModel``; reads only
    ``model.config``, so a pipeline stage's cut model and the whole model cost the same."""

    def batch_flops(self, model: nn.Module, batch: Mapping[str, Any]) -> float:
        if "block_sizes" in batch:
            return 3 * block_flops(model.config, batch)
        edges = batch["edge_index"].shape[1]
        if batch.get("stale_edge_index") is not None:
            edges += batch["stale_edge_index"].shape[1]
        return 3 * forward_flops(model.config, batch["x"].shape[0], edges)

    def sample_flops(self, model: nn.Module, units: int) -> float:
        return 3 * forward_flops(model.config, units, units * model.config.avg_degree)

    def activation_bytes_per_unit(self, model: nn.Module, bytes_per_elem: int, checkpointing: str) -> float:
        """Per node. ``none`` and ``selective`` (a GNN layer has no cheap element-wise part worth
        recomputing apart): every layer's saved rows (``SAVED_PER_LAYER``); ``full``: every
        layer's input state (2 rows for GCNII's (h, h0)) plus one layer's saved rows, live while
        it is recomputed. Always: the embedding's input (F) and output (d), the head's input (d)
        and the logits with the loss's softmax (2 C); with dropout, a 1-byte mask per dropped
        element (the embedding's F, every layer's and the head's d)."""
        cfg = model.config
        d, saved = cfg.hidden_size, SAVED_PER_LAYER[cfg.layer] * cfg.hidden_size
        if checkpointing in ("none", "selective"):
            layers = cfg.num_layers * saved
        elif checkpointing == "full":
            layers = cfg.num_layers * d * (2 if cfg.layer == "gcnii" else 1) + saved
        else:
            raise ValueError(f"checkpointing must be one of none, selective, full; got {checkpointing!r}")
        ends = cfg.in_features + 2 * d + 2 * cfg.num_classes
        masks = (cfg.in_features + (cfg.num_layers + 1) * d) if cfg.dropout > 0 else 0
        return float(bytes_per_elem * (layers + ends) + masks)

    def activated_params(self, model: nn.Module) -> int:
        """Every parameter: each node goes through every layer."""
        return sum(p.numel() for p in model.parameters())

    def report_lines(self, model: nn.Module, units: int) -> list[str]:
        return []  # history and bytes per mode: the engine's graph plan (veomni/planner/graph_plan.py)

    def stage_width(self, model: nn.Module) -> int:
        cfg = model.config
        return cfg.hidden_size * (2 if cfg.layer == "gcnii" else 1)

    def history_width(self, model: nn.Module) -> int:
        return model.config.hidden_size

    def aggregations(self, model: nn.Module) -> int:
        return model.config.num_layers

    def assumed_degree(self, model: nn.Module) -> float:
        return model.config.avg_degree
