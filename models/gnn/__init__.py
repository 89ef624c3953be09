"""GNN stacks for node classification: GCN, GraphSAGE (mean) and GCNII. Registered as "gnn":
trains with node classification on graph views (the "graph" dataset kind)."""

from veomni.contract import ModelSpec, register_model
from veomni.tasks import NodeClassificationTask

from .config import GNNConfig
from .cost import GNNCost
from .model import GNNModel

register_model(ModelSpec(
    name="gnn",
    config_cls=GNNConfig,
    build=GNNModel,
    task=lambda config: NodeClassificationTask(),
    dataset="graph",
    cost=GNNCost(),
))

__all__ = ["GNNConfig", "GNNModel"]
