"""The sampled plan's graph structure (``veomni.planner.sampled_plan.structure_bytes``) against the
tensors a built run keeps: the training and evaluation datasets of a generated graph, each past
its first mini-batch (the proximity order builds its neighbour list then), counted as distinct
storages alive in the process, features, feature cache and mini-batches aside. The samplers
share one copy of the in-edges and nothing keeps the edge list as loaded: on this graph 34 MB
where the run kept 114 MB before (the loaded and normalised edge lists, a copy per sampler)."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.graph_utils import community_graph
from veomni.config.schema import DataConfig
from veomni.data.graph.dataset import build_graph_dataset
from veomni.data.graph.format import GraphData, save_graph
from veomni.data.graph.source import sampled_graph
from veomni.data.kinds import DatasetRequest
from veomni.planner.sampled_plan import structure_bytes

NODES = 3_000


def _storages() -> dict[int, int]:
    gc.collect()
    found = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


@pytest.mark.parametrize("order", ["proximity", "random"])
def test_the_planned_structure_is_what_a_run_keeps(tmp_path, order: str) -> None:
    graph = community_graph(NODES, classes=3, features=8, seed=5)
    rest = ~graph["train_mask"]
    val = rest & (torch.arange(NODES) % 2 == 0)
    folder = save_graph(tmp_path / "graph", GraphData(
        x=graph["x"], y=graph["y"], edge_index=graph["edge_index"], train_mask=graph["train_mask"], val_mask=val,
        test_mask=rest & ~val, num_classes=3))
    edges = graph["edge_index"].shape[1]
    del graph, rest, val
    cfg = DataConfig(kind="graph", train_path=str(folder), eval_path=str(folder), graph_partitioner="bfs",
                     graph_fanouts=[4, 3], graph_batch_size=64, graph_batch_order=order, graph_cache_rows=100)
    model = type("M", (), {"in_features": 8, "num_classes": 3, "neighbour_norm": "mean"})()
    sampled_graph.cache_clear()
    before = _storages()
    datasets = [build_graph_dataset(DatasetRequest(cfg, str(folder), split, None, 0, 1, 0, model, 1))
                for split in ("train", "eval")]
    for dataset in datasets:
        next(iter(dataset))
    cache = datasets[0].features  # the feature matrix and the cache: lines of their own in the plan
    aside = {t.untyped_storage().data_ptr() for t in (cache.backing.x, cache.table, cache.slot_of, cache.node_in,
                                                       cache.stamp)}
    kept = sum(size for ptr, size in _storages().items() if ptr not in before and ptr not in aside)
    planned = structure_bytes(NODES, edges, samplers=2, proximity=order == "proximity")
    if order == "proximity":  # this graph stores each edge both ways: the neighbour list is the lower bound
        planned -= 8 * edges
    assert 0.95 * kept <= planned <= 1.05 * kept, (kept, planned)

