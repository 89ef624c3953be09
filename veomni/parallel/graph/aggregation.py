"""Installing an aggregation at the models' injection point: one installer serves graph
parallelism (``halo.GraphAggregation``) and sampled mini-batches (``BlockAggregation``).

Every message-passing module the plan names (``ParallelPlan.message_passing``) holds a
``veomni.ops.graph.NeighbourAggregation`` as ``aggregate``; a recipe replaces it from outside, so
the model is written once for a whole graph in one process.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from veomni.contract.graph_model import message_passing_modules
from veomni.contract.plan import ParallelPlan
from veomni.errors import BadConfig
from veomni.ops.graph import BlockAggregation, NeighbourAggregation


def replace_aggregations(model: nn.Module, plan: ParallelPlan, make: Callable[[int], nn.Module], why: str) -> int:
    """Put ``make(i)`` in place of the ``NeighbourAggregation`` of the i-th message-passing module
    the plan names (``why``: who replaces it, for the error); returns how many."""
    modules = message_passing_modules(model, plan.message_passing)
    for index, (name, module) in enumerate(modules):
        if not isinstance(module.aggregate, NeighbourAggregation):
            raise TypeError(f"{type(model).__name__}: {name} ({type(module).__name__}) holds a "
                            f"{type(module.aggregate).__name__} as `aggregate`, not the veomni.ops.graph."
                            f"NeighbourAggregation {why} replaces; declare the injection point in the layer")
        module.aggregate = make(index)
    return len(modules)


def block_sampling_problems(model: nn.Module, plan: ParallelPlan, hops: int, pp: int) -> list[str]:
    """What stops sampled training of ``model`` with ``hops`` sampled hops (``data.graph_fanouts``)
    under ``pp`` pipeline stages: the launcher's check, and the installer's."""
    layers = len(message_passing_modules(model, plan.message_passing))
    problems = []
    if not layers:
        problems.append(f"data.graph_fanouts: {type(model).__name__} has no message-passing layers to sample for")
    elif hops != layers:
        problems.append(f"data.graph_fanouts has {hops} entries, the model has {layers} message-passing layers: "
                        f"give one fanout per layer (e.g. {[10] * layers}; -1 takes every neighbour)")
    if pp > 1:
        problems.append(f"data.graph_fanouts with parallel.pp={pp}: sampled mini-batches train data-parallel "
                        "(each rank its own partition's targets); set parallel.pp: 1, or empty data.graph_fanouts "
                        "for GNNPipe")
    return problems


def apply_block_sampling(model: nn.Module, plan: ParallelPlan, hops: int | None = None) -> int:
    """Make every message-passing module read its layer's block of a sampled mini-batch; ``hops``:
    the sampled hops, refused (``BadConfig``) unless one per message-passing module."""
    if hops is not None and (problems := block_sampling_problems(model, plan, hops, 1)):
        raise BadConfig("; ".join(problems))
    return replace_aggregations(model, plan, BlockAggregation, "sampled training")
