"""The GNN stack for node classification: embed, message-passing layers, head.

``forward(x, graph)`` is ``head(layers(embed(x)))`` with one state tensor passed along (``[n, d]``
for GCN and SAGE, ``[n, 2, d]`` = (h, h0) for GCNII, see ``layers.py``), so a pipeline stage, whose
``embed``/``head`` the cutter replaces by ``nn.Identity``, runs this same forward on the state it
receives. The plan names every layer as a block (FSDP unit, pipeline cut point) and as a
message-passing module (the engine replaces its ``aggregate`` for graph parallelism and
historical embeddings).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from veomni.contract.plan import ParallelPlan

from .config import GNNConfig
from .layers import LAYER_CLASSES, reset_linear


class Embed(nn.Module):
    """Node features -> the first state: ``relu(lin(dropout(x)))``, as (h, h0) for GCNII."""

    def __init__(self, config: GNNConfig) -> None:
        super().__init__()
        self.dropout = config.dropout
        self.stacked = config.layer == "gcnii"
        self.lin = nn.Linear(config.in_features, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.lin(F.dropout(x, self.dropout, self.training)))
        return torch.stack([h, h], dim=1) if self.stacked else h


class Head(nn.Module):
    """The last state's h -> class logits: ``lin(dropout(h))``."""

    def __init__(self, config: GNNConfig) -> None:
        super().__init__()
        self.dropout = config.dropout
        self.stacked = config.layer == "gcnii"
        self.lin = nn.Linear(config.hidden_size, config.num_classes)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        h = state[:, 0] if self.stacked else state
        return self.lin(F.dropout(h, self.dropout, self.training))


class GNNModel(nn.Module):
    def __init__(self, config: GNNConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = Embed(config)
        layer_cls = LAYER_CLASSES[config.layer]
        self.layers = nn.ModuleList(layer_cls(config, i) for i in range(config.num_layers))
        self.head = Head(config)

    def forward(self, x: torch.Tensor, graph: Mapping[str, Any]) -> torch.Tensor:
        """Logits [n, num_classes] of the view's n target nodes (on a middle pipeline stage: the
        state after this stage's layers)."""
        state = self.embed(x)
        for layer in self.layers:
            state = layer(state, graph)
        return self.head(state)

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(blocks=("layers.*",), stages=("embed", "layers", "head"), message_passing=("layers.*",))

    def init_weights(self) -> None:
        """Glorot weights and zero biases everywhere, from the global RNG."""
        reset_linear(self.embed.lin)
        for layer in self.layers:
            layer.reset_parameters()
        reset_linear(self.head.lin)
