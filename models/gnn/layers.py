"""The message-passing layers: GCN, GraphSAGE (mean) and GCNII, one hidden width throughout.

Each layer aggregates first and transforms after: ``self.aggregate`` (the engine's injection
point, ``veomni.ops.graph.NeighbourAggregation``) sums the in-neighbours' rows with the weights
the graph view already holds, then the layer's linear maps act on one row per target node. So a
layer's matmuls cost per target row, whatever the neighbourhood, and the rows that cross graph
partitions or are kept in the history are the layer's input ``h``, one hidden-wide row per node.

The convolutions match ``torch_geometric``'s (the parity tests copy weights between them):

- ``GCNLayer``: ``GCNConv``: ``A h W + b`` with ``A`` the symmetric normalisation with
  self-loops (``A (h W) = (A h) W``, so aggregating first is the same map);
- ``SAGELayer``: ``SAGEConv(aggr="mean")``: ``lin_l(mean_j h_j) + lin_r(h_i)``;
- ``GCNIILayer``: ``GCN2Conv(shared_weights=True)`` as layer ``l`` (1-based):
  ``((1 - alpha) A h + alpha h0) ((1 - beta_l) I + beta_l W)``, ``beta_l = log(theta / l + 1)``.

Around the convolution, as the deep variants do: dropout on the layer's input, ReLU on its
output, and for GCN and SAGE a residual ``h + relu(conv(h))`` (ResGCN, Li et al. 2019) so stacks
of 8 to 64 layers train; GCNII needs none (its initial residual and identity mapping play that
part). A GCNII layer's state is ``[n, 2, d]`` = (h, h0) so that a pipeline stage boundary passes
one tensor; GCN and SAGE states are ``[n, d]``.

On a sampled mini-batch (``veomni/data/graph/sampling.py``) a layer's targets are the first
``m`` of its ``n`` input rows and ``aggregate`` returns ``m`` rows, so each layer slices its own
rows (residual, root weight, h0) to the aggregate's length: a no-op on a whole graph or view.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from veomni.ops.graph import NeighbourAggregation

from .config import GNNConfig


def reset_linear(lin: nn.Linear) -> None:
    """Glorot-uniform weight and zero bias, as ``torch_geometric`` initialises its layers."""
    nn.init.xavier_uniform_(lin.weight)
    if lin.bias is not None:
        nn.init.zeros_(lin.bias)


class GCNLayer(nn.Module):
    """``h + relu(A dropout(h) W + b)``."""

    def __init__(self, config: GNNConfig, index: int) -> None:
        super().__init__()
        self.dropout = config.dropout
        self.aggregate = NeighbourAggregation()
        self.lin = nn.Linear(config.hidden_size, config.hidden_size)

    def reset_parameters(self) -> None:
        reset_linear(self.lin)

    def forward(self, h: torch.Tensor, graph: Mapping[str, Any]) -> torch.Tensor:
        x = F.dropout(h, self.dropout, self.training)
        agg = self.aggregate(x, graph)
        return h[:agg.shape[0]] + F.relu(self.lin(agg))


class SAGELayer(nn.Module):
    """``h + relu(lin_l(mean of dropout(h) over in-neighbours) + lin_r(dropout(h)))``."""

    def __init__(self, config: GNNConfig, index: int) -> None:
        super().__init__()
        self.dropout = config.dropout
        self.aggregate = NeighbourAggregation()
        self.lin_l = nn.Linear(config.hidden_size, config.hidden_size)
        self.lin_r = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def reset_parameters(self) -> None:
        reset_linear(self.lin_l)
        reset_linear(self.lin_r)

    def forward(self, h: torch.Tensor, graph: Mapping[str, Any]) -> torch.Tensor:
        x = F.dropout(h, self.dropout, self.training)
        agg = self.aggregate(x, graph)
        m = agg.shape[0]
        return h[:m] + F.relu(self.lin_l(agg) + self.lin_r(x[:m]))


class GCNIILayer(nn.Module):
    """State (h, h0) [n, 2, d] -> (relu(GCN2Conv(dropout(h), h0)), h0); ``index`` is 0-based."""

    def __init__(self, config: GNNConfig, index: int) -> None:
        super().__init__()
        self.dropout = config.dropout
        self.alpha = config.alpha
        self.beta = math.log(config.theta / (index + 1) + 1)
        self.aggregate = NeighbourAggregation()
        self.weight = nn.Parameter(torch.empty(config.hidden_size, config.hidden_size))

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.weight)

    def forward(self, state: torch.Tensor, graph: Mapping[str, Any]) -> torch.Tensor:
        h, h0 = state.unbind(1)
        x = F.dropout(h, self.dropout, self.training)
        agg = self.aggregate(x, graph)
        h0 = h0[:agg.shape[0]]
        mixed = (1 - self.alpha) * agg + self.alpha * h0
        out = torch.addmm(mixed, mixed, self.weight, beta=1 - self.beta, alpha=self.beta)
        return torch.stack([F.relu(out), h0], dim=1)


LAYER_CLASSES: dict[str, type[nn.Module]] = {"gcn": GCNLayer, "sage": SAGELayer, "gcnii": GCNIILayer}
"""``GNNConfig.layer`` -> its layer class, built as ``cls(config, index)``."""
