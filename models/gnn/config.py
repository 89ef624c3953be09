"""Configuration of the GNN stack: which message-passing layer, how wide, how deep.

One config serves the three layer kinds the family implements (``layers.py``): GCN, GraphSAGE
with mean aggregation, and GCNII. It satisfies ``veomni.ops.graph.GraphModelConfig``: the graph
dataset reads ``in_features``/``num_classes`` to check the data against it and
``neighbour_norm`` to normalise the edges the way the layers expect.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYERS = ("gcn", "sage", "gcnii")


@dataclass
class GNNConfig:
    """Defaults: GCNII on Cora as in its paper (64 layers of width 64, dropout 0.6, alpha 0.1,
    lambda 0.5)."""

    layer: str = "gcnii"
    """``gcn`` (Kipf & Welling), ``sage`` (GraphSAGE, mean aggregator) or ``gcnii`` (Chen et al.
    2020: initial residual and identity mapping)."""
    in_features: int = 1433
    hidden_size: int = 64
    num_classes: int = 7
    num_layers: int = 64
    """Message-passing layers (the embedding and the head are linear maps around them)."""
    dropout: float = 0.6
    """Dropout on every layer's input, the embedding's input and the head's input."""
    alpha: float = 0.1
    """GCNII: weight of the initial representation h0 in every layer (initial residual)."""
    theta: float = 0.5
    """GCNII's lambda: layer l mixes in its weight by ``beta_l = log(theta / l + 1)``."""
    avg_degree: float = 10.0
    """In-edges per node (self-loop included) assumed by ``--dry-run``'s FLOP estimate only;
    training counts the edges of each graph view."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def neighbour_norm(self) -> str:
        """The edge normalisation the layers expect (``veomni.data.graph.views.edge_weights``):
        GCN's symmetric one with self-loops for gcn/gcnii, the in-neighbour mean for sage."""
        return "mean" if self.layer == "sage" else "gcn"

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first wrong field and what it accepts."""
        if self.layer not in LAYERS:
            raise ValueError(f"layer must be one of {', '.join(LAYERS)}, got {self.layer!r}")
        for name in ("in_features", "hidden_size", "num_classes", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha (GCNII's initial-residual weight) must be in [0, 1], got {self.alpha!r}")
        if self.theta <= 0:
            raise ValueError(f"theta (GCNII's lambda) must be > 0 so every beta_l = log(theta / l + 1) is > 0, "
                             f"got {self.theta!r}")
        if self.avg_degree <= 0:
            raise ValueError(f"avg_degree must be > 0 (in-edges per node, for --dry-run), got {self.avg_degree!r}")
