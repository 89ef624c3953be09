"""GNN family: each layer against torch_geometric's convolution (values and input gradients),
deep GCNII stacks train finitely, the plan matches the model, a pipeline cut runs the same
forward, the FLOP count, and config errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from torch_geometric.nn import GCN2Conv, GCNConv, SAGEConv

from models.gnn.config import GNNConfig
from models.gnn.layers import GCNIILayer, GCNLayer, SAGELayer
from tests.parity_utils import assert_parity
from veomni.contract import build_config, build_model, get_model_spec
from veomni.contract.graph_model import GraphModelConfig
from veomni.contract.plan import match_modules
from veomni.data.graph.sampling import NeighbourSampler, in_edges
from veomni.data.graph.views import edge_weights, partition_views, split_labels
from veomni.ops.graph import NeighbourAggregation
from veomni.parallel.graph.aggregation import apply_block_sampling
from veomni.parallel.graph.halo import apply_graph_parallel
from veomni.parallel.pipeline.stages import cut_stage
from veomni.tasks import NodeClassificationTask

NODES, ISOLATED, WIDTH = 50, 5, 16
SMALL = dict(in_features=12, hidden_size=WIDTH, num_classes=4, dropout=0.0)


def _graph() -> torch.Tensor:
    """~300 distinct directed edges among the first 45 nodes, some of them self-loops; the last
    ``ISOLATED`` nodes have no edge at all."""
    gen = torch.Generator().manual_seed(0)
    linked = NODES - ISOLATED
    edges = torch.randint(0, linked, (2, 300), generator=gen)
    loops = torch.arange(5).repeat(2, 1) * 7
    return torch.unique(torch.cat([edges, loops], dim=1), dim=1)


def _views(norm: str, num_chunks: int = 1, features: int = WIDTH):
    """(chunk views, whole view) of one partition holding the whole random graph."""
    gen = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 4, (NODES,), generator=gen)
    fields = {"x": torch.randn(NODES, features, generator=gen),
              "labels": split_labels(labels, torch.rand(NODES, generator=gen) < 0.6)}
    edge_index, weight = edge_weights(_graph(), NODES, norm)
    zeros = torch.zeros(NODES, dtype=torch.long)
    return partition_views(edge_index, weight, fields, zeros, 1, 0, torch.arange(NODES) % num_chunks, num_chunks)


def _check(ours: torch.Tensor, ref: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    assert ours.shape == ref.shape
    assert_parity(ours, ref, "output")
    cotangent = torch.randn(ours.shape, generator=torch.Generator().manual_seed(2))
    ours_grads = torch.autograd.grad(ours, inputs, cotangent)
    ref_grads = torch.autograd.grad(ref, inputs, cotangent)
    for i, (a, b) in enumerate(zip(ours_grads, ref_grads)):
        assert_parity(a, b, f"gradient of input {i}")


def _input() -> torch.Tensor:
    return torch.randn(NODES, WIDTH, generator=torch.Generator().manual_seed(3)).requires_grad_()


def test_gcn_layer_matches_torch_geometric():
    torch.manual_seed(0)
    conv = GCNConv(WIDTH, WIDTH)
    nn.init.normal_(conv.bias)
    layer = GCNLayer(GNNConfig(layer="gcn", **SMALL), 0)
    layer.lin.weight.data.copy_(conv.lin.weight)
    layer.lin.bias.data.copy_(conv.bias)
    h = _input()
    _check(layer(h, _views("gcn")[1]), h + torch.relu(conv(h, _graph())), [h])


def test_sage_layer_matches_torch_geometric():
    torch.manual_seed(0)
    conv = SAGEConv(WIDTH, WIDTH, aggr="mean")
    layer = SAGELayer(GNNConfig(layer="sage", **SMALL), 0)
    layer.load_state_dict({k: v for k, v in conv.state_dict().items() if k.startswith(("lin_l.", "lin_r."))})
    h = _input()
    _check(layer(h, _views("mean")[1]), h + torch.relu(conv(h, _graph())), [h])


@pytest.mark.parametrize("index", [0, 2, 31])
def test_gcnii_layer_matches_torch_geometric(index):
    torch.manual_seed(0)
    config = GNNConfig(layer="gcnii", alpha=0.2, theta=0.7, **SMALL)
    conv = GCN2Conv(WIDTH, config.alpha, config.theta, layer=index + 1, shared_weights=True, normalize=True)
    layer = GCNIILayer(config, index)
    layer.weight.data.copy_(conv.weight1)
    h, h0 = _input(), torch.randn(NODES, WIDTH, generator=torch.Generator().manual_seed(4)).requires_grad_()
    out = layer(torch.stack([h, h0], dim=1), _views("gcn")[1])
    assert torch.equal(out[:, 1], h0)
    _check(out[:, 0], torch.relu(conv(h, h0, _graph())), [h, h0])


def _model(num_layers: int, **options):
    torch.manual_seed(0)
    config, model = build_model("gnn", SMALL | {"in_features": 12, "num_layers": num_layers} | options)
    model.init_weights()
    return config, model


@pytest.mark.parametrize("num_layers", [8, 32])
def test_deep_gcnii_trains_finitely(num_layers):
    config, model = _model(num_layers, layer="gcnii", dropout=0.5)
    view = _views(config.neighbour_norm, features=12)[1]
    model.train()
    out = NodeClassificationTask()(model, view)
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum) and out.loss_sum > 0 and out.loss_units > 0
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), grads.keys()
    assert grads["embed.lin.weight"].abs().sum() > 0 and grads["layers.0.weight"].abs().sum() > 0


@pytest.mark.parametrize("layer", ["gcn", "sage", "gcnii"])
def test_plan_names_the_layers_and_a_pipeline_cut_runs_the_same_forward(layer):
    config, model = _model(4, layer=layer)
    plan = model.parallel_plan()
    assert [name for name, _ in match_modules(model, plan.blocks)] == [f"layers.{i}" for i in range(4)]
    assert all(isinstance(m.aggregate, NeighbourAggregation) for _, m in match_modules(model, plan.message_passing))
    assert [model.get_submodule(piece) is not None for piece in plan.stages] == [True] * 3
    view = _views(config.neighbour_norm, features=12)[1]
    model.eval()
    expected = model(view["x"], view)
    first, last = cut_stage(copy.deepcopy(model), 0, [3, 1]), cut_stage(copy.deepcopy(model), 1, [3, 1])
    assert isinstance(first.head, nn.Identity) and isinstance(last.embed, nn.Identity)
    assert torch.equal(last(first(view["x"], view), view), expected)
    assert apply_graph_parallel(model, plan, None) == 4  # the engine's aggregation, one partition
    assert_parity(model(view["x"], view), expected, "output after graph parallel")


@pytest.mark.parametrize("layer", ["gcn", "sage", "gcnii"])
def test_batch_flops_count_the_matmuls_and_add_up_over_chunks(layer):
    """The linear maps' FLOPs are what torch counts for forward + backward (no input gradient for
    ``x``); the aggregation's 2 E d per layer, over fresh and stale edges, sums over the chunks of
    an epoch to the whole view's."""
    config, model = _model(3, layer=layer)
    cost = get_model_spec("gnn").cost
    chunks, whole = _views(config.neighbour_norm, num_chunks=3, features=12)
    edges, nodes, d = whole["edge_index"].shape[1], NODES, config.hidden_size
    with FlopCounterMode(display=False) as counter:
        model(whole["x"], whole).sum().backward()
    aggregation = 3 * config.num_layers * 2 * edges * d
    # torch counts the aggregation's sparse CSR product (forward and input gradient) as a dense one
    dense_aggregation = config.num_layers * 2 * 2 * nodes * nodes * d
    assert (cost.batch_flops(model, whole) - aggregation - 2 * nodes * 12 * d
            == counter.get_total_flops() - dense_aggregation)
    assert sum(cost.batch_flops(model, v) for v in chunks) == cost.batch_flops(model, whole)
    assert cost.sample_flops(model, nodes) == cost.batch_flops(model, whole) + aggregation * (
        config.avg_degree * nodes / edges - 1)


@pytest.mark.parametrize("layer", ["sage", "gcnii"])
def test_batch_flops_of_a_sampled_mini_batch_count_its_blocks(layer):
    """Layer l of a sampled mini-batch transforms block_sizes[l + 1] rows and aggregates its own
    block's edges: the matmuls torch counts, plus 2 E_l d per block and pass."""
    config, model = _model(2, layer=layer)
    apply_block_sampling(model, model.parallel_plan(), 2)
    edges, weight = edge_weights(torch.randint(0, NODES, (2, 200), generator=torch.Generator().manual_seed(1)),
                                 NODES, config.neighbour_norm)
    sampler = NeighbourSampler(in_edges(edges, weight, NODES), torch.arange(8), {"x": torch.randn(NODES, 12)}, 8,
                               [3, 2])
    batch = next(iter(sampler))
    sizes, d = batch["block_sizes"].tolist(), config.hidden_size
    with FlopCounterMode(display=False) as counter:
        model(batch["x"], batch).sum().backward()
    block_edges = [batch[f"block{i}_edge_index"].shape[1] for i in range(2)]
    aggregation = 3 * sum(2 * e * d for e in block_edges)
    dense_aggregation = sum(2 * 2 * sizes[i + 1] * sizes[i] * d for i in range(2))  # torch's count of the CSR product
    assert (get_model_spec("gnn").cost.batch_flops(model, batch) - aggregation - 2 * sizes[0] * 12 * d
            == counter.get_total_flops() - dense_aggregation)


def test_spec_config_and_validation_errors():
    spec = get_model_spec("gnn")
    assert spec.dataset == "graph" and isinstance(spec.task(GNNConfig()), NodeClassificationTask)
    assert isinstance(GNNConfig(), GraphModelConfig)
    assert [GNNConfig(layer=k).neighbour_norm for k in ("gcn", "sage", "gcnii")] == ["gcn", "mean", "gcn"]
    for options, message in [({"layer": "gat"}, "layer must be one of gcn, sage, gcnii"),
                             ({"num_layers": 0}, "num_layers must be a positive int"),
                             ({"hidden_size": 1.5}, "hidden_size must be a positive int"),
                             ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
                             ({"alpha": 1.5}, "alpha"),
                             ({"theta": 0.0}, "theta"),
                             ({"avg_degree": 0}, "avg_degree")]:
        with pytest.raises(ValueError, match=message):
            build_config("gnn", options)
