"""What a graph family declares to the engine: the config fields a graph dataset reads, and the
cost hooks the ``--dry-run`` planner asks (``veomni/planner/graph_plan.py``), and what a plan's
message-passing module declares. Part of the model contract, beside the plan and the spec; the
kernels live in ``veomni/ops/graph.py``."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import nn

from veomni.contract.hooks import declared_modules


@runtime_checkable
class GraphModelConfig(Protocol):
    """What a graph dataset kind reads from the config of the model it feeds."""

    in_features: int
    num_classes: int
    neighbour_norm: str
    """The neighbour normalisation the model's layers expect in ``edge_weight``: ``gcn``,
    ``mean`` or ``sum`` (``veomni.data.graph.views.edge_weights``)."""


@runtime_checkable
class GraphCost(Protocol):
    """What a graph family's cost model adds for ``--dry-run``'s communication and history lines."""

    def stage_width(self, model: nn.Module) -> int:
        """Elements per node that cross a pipeline stage boundary (GCNII's (h, h0): 2 d)."""
        ...

    def history_width(self, model: nn.Module) -> int:
        """Elements per node of one layer's history row (the rows ``aggregate`` receives)."""
        ...

    def aggregations(self, model: nn.Module) -> int:
        """Message-passing layers (history tables; halo exchanges per forward)."""
        ...

    def assumed_degree(self, model: nn.Module) -> float:
        """In-edges per node to plan with before the graph exists."""
        ...


@runtime_checkable
class MessagePassingLayer(Protocol):
    """A module the plan lists under ``message_passing``: its forward aggregates neighbour rows
    through ``self.aggregate(x, graph)``, a ``veomni.ops.graph.NeighbourAggregation`` by default,
    the injection point graph parallelism and layer pipelines replace."""

    aggregate: nn.Module


def message_passing_modules(model: nn.Module, patterns: tuple[str, ...]) -> list[tuple[str, Any]]:
    """The plan's message-passing modules of ``model``, each a ``MessagePassingLayer`` (``TypeError``
    naming the model and the module if not)."""
    return declared_modules(model, patterns, MessagePassingLayer, "message_passing",
                            "an `aggregate` injection point (a veomni.ops.graph.NeighbourAggregation)")
