"""A user's own graph becomes a graph folder in one call (``write_graph_folder``) and trains with
the GNN recipe; edge weights scale the neighbour normalisation, and duplicate edges merge."""

from __future__ import annotations

import json
import math

import networkx as nx
import pytest
import torch

from tests.launch.test_launch import train_sh
from veomni.data.graph.format import file_problems, load_graph, read_manifest
from veomni.data.graph.views import edge_weights
from veomni.data.graph.writer import write_graph_folder

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

CLASSES, FEATURES = 3, 8


def _networkx_graph(nodes_per_class: int = 20, weighted: bool = False) -> nx.Graph:
    """Three communities; a node's features are its class's one-hot plus noise, its label the class."""
    graph = nx.stochastic_block_model([nodes_per_class] * CLASSES, [[0.3, 0.02, 0.02], [0.02, 0.3, 0.02],
                                                                    [0.02, 0.02, 0.3]], seed=0)
    generator = torch.Generator().manual_seed(0)
    for _, data in graph.nodes(data=True):
        label = data["block"]
        data["y"] = label
        data["x"] = (torch.nn.functional.one_hot(torch.tensor(label), FEATURES).float()
                     + 0.1 * torch.randn(FEATURES, generator=generator)).tolist()
    if weighted:
        for a, b, data in graph.edges(data=True):
            data["weight"] = 1.0 + (a + b) % 3
    return graph


def test_a_networkx_graph_round_trips(tmp_path):
    graph = _networkx_graph(weighted=True)
    folder = write_graph_folder(tmp_path / "g", graph, seed=1)
    assert file_problems(folder, read_manifest(folder)) == []
    loaded = load_graph(folder)
    assert loaded.num_nodes == graph.number_of_nodes() and loaded.num_classes == CLASSES
    assert loaded.num_edges == 2 * graph.number_of_edges()  # both directions of an undirected edge
    assert loaded.edge_weight is not None and set(loaded.edge_weight.tolist()) == {1.0, 2.0, 3.0}
    masks = loaded.train_mask.int() + loaded.val_mask.int() + loaded.test_mask.int()
    assert bool((masks == 1).all()) and int(loaded.train_mask.sum()) == 36  # 0.6 of the 60 labelled nodes


def test_a_torch_geometric_data_round_trips_with_its_own_masks(tmp_path):
    from torch_geometric.data import Data
    from torch_geometric.utils import from_networkx

    data = from_networkx(_networkx_graph(), group_node_attrs=["x"])  # PyG's own conversion, both directions
    data.train_mask = torch.arange(data.num_nodes) % 2 == 0
    data.val_mask, data.test_mask = ~data.train_mask, torch.zeros(data.num_nodes, dtype=torch.bool)
    folder = write_graph_folder(tmp_path / "g", Data(x=data.x, y=data.y, edge_index=data.edge_index,
                                                     train_mask=data.train_mask, val_mask=data.val_mask,
                                                     test_mask=data.test_mask), undirected=False)
    loaded = load_graph(folder)
    assert torch.equal(loaded.edge_index, data.edge_index) and torch.equal(loaded.x, data.x)
    assert torch.equal(loaded.train_mask, data.train_mask) and int(loaded.test_mask.sum()) == 0


def test_a_bad_graph_is_refused_naming_the_problem(tmp_path):
    with pytest.raises(ValueError, match=r"edge_weight holds weights that are not finite and > 0"):
        write_graph_folder(tmp_path / "g", x=torch.zeros(3, 2), y=[0, 1, 0], edge_index=[[0, 1], [1, 2]],
                           edge_weight=[1.0, float("nan")])
    assert not (tmp_path / "g").exists()


def test_duplicate_edges_merge_and_their_weights_add():
    """Two copies of 0->1 of weight 1 and 2 act as one edge of weight 3; without weights, as one
    edge of weight 1 (``torch_geometric`` would count the copy twice)."""
    edges = torch.tensor([[0, 0, 2], [1, 1, 1]])
    merged, weight = edge_weights(edges, 3, "sum", torch.tensor([1.0, 2.0, 4.0]))
    assert merged.tolist() == [[0, 2], [1, 1]] and weight.tolist() == [3.0, 4.0]
    _, mean = edge_weights(edges, 3, "mean", torch.tensor([1.0, 2.0, 4.0]))
    assert mean.tolist() == pytest.approx([3 / 7, 4 / 7])
    _, unweighted = edge_weights(edges, 3, "mean")
    assert unweighted.tolist() == [0.5, 0.5]


def test_a_written_networkx_graph_trains_with_the_gnn_recipe(tmp_path):
    folder = write_graph_folder(tmp_path / "graph", _networkx_graph(weighted=True))
    result = train_sh("recipes/gnnpipe/tiny.yaml", "--data.train_path", str(folder), "--data.eval_path", str(folder),
                      "--data.prepare", "null", "--model.in_features", str(FEATURES), "--model.num_classes",
                      str(CLASSES), "--model.hidden_size", "16", "--model.num_layers", "4", "--train.max_steps", "2",
                      "--train.eval_interval", "2", "--log.interval", "1", "--checkpoint.interval", "0",
                      "--train.output_dir", str(tmp_path / "out"), "--data.tokens_per_micro_batch", "15")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    losses = [record["loss"] for record in records if "loss" in record]
    assert len(losses) == 2 and all(math.isfinite(loss) and loss > 0 for loss in losses), records
    assert any("eval_accuracy" in record for record in records), records
