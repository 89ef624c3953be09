"""Graph parallelism and historical embeddings, installed at the models' aggregation point.

Every message-passing module the plan names (``ParallelPlan.message_passing``) gets a
``GraphAggregation`` in place of its ``aggregate`` (``veomni.ops.graph.NeighbourAggregation``).
For one graph view (one chunk of this rank's partition, ``veomni/data/graph/views.py``) it:

1. exchanges halo rows with the other partitions of the data-parallel group: the rows other
   partitions need are sent with one uneven all-to-all and this chunk's halo rows received, and
   the backward pass sends their gradients home along the same routes (forward and backward,
   so graph-parallel gradients equal one process's);
2. sums each target's fresh neighbours (its chunk's rows and the received halo rows: these carry
   gradients) and its stale ones (rows of other chunks, read from this layer's history table:
   constants, as in GNNPipe and PipeGCN);
3. writes this chunk's rows and the received halo rows into the history, so chunks that run
   later in the epoch read them fresh, and chunks that ran earlier read them next epoch;
4. optionally (``data.graph_stale_gradients``) sends gradients back along the stale edges one
   epoch late (``StaleGradients``), so edges between chunks train both of their ends.

The history is one [rows, width] table per layer, allocated on the first chunked view (views
of a one-chunk run keep none). It is not checkpointed: the graph dataset makes the first epoch
after a resume exact (the whole partition at once), which refills every row.

Bytes are counted per direction (``graph_halo``: forward rows and backward gradients), so the
communication of a recipe can be checked against its formula.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from veomni.contract.plan import ParallelPlan
from veomni.ops.graph import aggregate, has_stale_edges, sparse_adjacency
from veomni.parallel.comm_counter import COMM_COUNTER
from veomni.parallel.graph.aggregation import replace_aggregations

logger = logging.getLogger(__name__)


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    row_bytes = x[0].numel() * x.element_size() if x.shape[0] else 0
    COMM_COUNTER.record("graph_halo", (sum(send) - send[dist.get_rank(group)]) * row_bytes)
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _HaloExchange(torch.autograd.Function):
    """Rows out along the send routes; their gradients back along the same routes reversed."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(rows, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def exchange_halo(h: torch.Tensor, graph: Mapping[str, Any], group: dist.ProcessGroup) -> torch.Tensor:
    """The halo rows this chunk receives, in the view's order (differentiable)."""
    rows = h.index_select(0, graph["send_index"])
    return _HaloExchange.apply(rows, graph["send_counts"].tolist(), graph["recv_counts"].tolist(), group)


class GraphAggregation(nn.Module):
    """``NeighbourAggregation`` over a partitioned, chunked graph (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.group = group
        self.history: torch.Tensor | None = None
        self.stale_grads = StaleGradients()

    def forward(self, h: torch.Tensor, graph: Mapping[str, Any]) -> torch.Tensor:
        received = exchange_halo(h, graph, self.group) if self.group is not None else None
        table = h if received is None else torch.cat([h, received])
        n = h.shape[0]
        out = aggregate(table, graph["edge_index"], graph["edge_weight"], n,
                        sparse_adjacency(graph, "edge_index", table.shape[0], n))
        if int(graph["chunks"]) == 1:
            return out
        history = self._history(graph, h)
        if has_stale_edges(graph):
            out = out + aggregate(history, graph["stale_edge_index"], graph["stale_edge_weight"], n,
                                  sparse_adjacency(graph, "stale_edge_index", history.shape[0], n))
        if bool(graph.get("stale_gradients", False)) and torch.is_grad_enabled():
            self.stale_grads.attach(h, out, graph, history)
        history.index_copy_(0, graph["node_rows"], h.detach().to(history.dtype))
        if received is not None:
            history.index_copy_(0, graph["halo_rows"], received.detach().to(history.dtype))
        return out

    def _history(self, graph: Mapping[str, Any], h: torch.Tensor) -> torch.Tensor:
        shape = (int(graph["history_rows"]), *h.shape[1:])
        if self.history is None or self.history.shape != shape or self.history.device != h.device:
            self.history = h.new_zeros(shape, dtype=h.dtype)
        return self.history


class StaleGradients:
    """Gradients along stale edges, delivered one epoch late (as PipeGCN does for boundary rows).

    A stale edge reads its source row from the history, so backward stops there; without this,
    an edge between two chunks never trains the source side. Here each chunk's backward adds
    ``w * grad(target)`` for its stale edges into ``collected`` (a table shaped like the history),
    and in the next epoch each chunk's backward adds its rows of what was collected to the
    gradient of its layer input. Delivering only the previous epoch's sums makes the result
    independent of the order chunks run their backward in (GPipe and 1F1B agree with one
    process). A new epoch is recognised when a chunk's rows come round again; an exact epoch (a
    whole view: no stale edges, exact gradients) drops what is pending. Halo rows' sums stay
    undelivered (their owners are on other ranks).
    """

    def __init__(self) -> None:
        self.collected: torch.Tensor | None = None
        self.due: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None

    def attach(self, h: torch.Tensor, out: torch.Tensor, graph: Mapping[str, Any], history: torch.Tensor) -> None:
        rows = graph["node_rows"]
        if not has_stale_edges(graph):
            self.collected = self.due = self.seen = None
            return
        if self.collected is None or self.collected.shape != history.shape:
            self.collected, self.due = torch.zeros_like(history), None
            self.seen = torch.zeros(history.shape[0], dtype=torch.bool, device=history.device)
        if bool(self.seen[rows].any()):  # these rows ran before: a new epoch
            self.due, self.collected = self.collected, torch.zeros_like(history)
            self.seen.zero_()
        self.seen[rows] = True
        if out.requires_grad:
            out.register_hook(functools.partial(_collect, self.collected, graph["stale_edge_index"],
                                                graph["stale_edge_weight"]))
        if self.due is not None and h.requires_grad:
            h.register_hook(functools.partial(_deliver, self.due, rows))


def _collect(table: torch.Tensor, edges: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> None:
    flat = grad.reshape(grad.shape[0], -1)
    messages = flat.index_select(0, edges[1]) * weight.to(grad.dtype).unsqueeze(-1)
    table.view(table.shape[0], -1).index_add_(0, edges[0], messages.to(table.dtype))


def _deliver(table: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return grad + table.index_select(0, rows).to(grad.dtype)


def apply_graph_parallel(model: nn.Module, plan: ParallelPlan, group: dist.ProcessGroup | None) -> int:
    """Install a ``GraphAggregation`` (exchanging over ``group``; None: one partition) in every
    message-passing module; returns how many."""
    return replace_aggregations(model, plan, lambda index: GraphAggregation(group), "graph parallelism")
