"""Neighbour sampling (``veomni/data/graph/sampling.py``): full-fanout mini-batches equal
full-graph training restricted to their targets (loss and gradients, GCN / GraphSAGE / GCNII);
sampled blocks against a brute-force sampler's definition written here; exact resume mid-epoch.

torch_geometric's ``NeighborLoader`` is not the reference here: it needs ``pyg-lib`` or
``torch-sparse``, which are not installed (its sampler raises ``ImportError`` without them).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from tests.graph_utils import community_graph, tiny_gnn
from tests.parity_utils import assert_grads_parity, assert_parity, assert_scalar_parity
from veomni.data.graph.sampling import NeighbourSampler, in_edges
from veomni.data.graph.views import edge_weights, split_labels
from veomni.errors import BadConfig
from veomni.parallel.graph.aggregation import apply_block_sampling
from veomni.tasks import NodeClassificationTask


def _sparse_graph(nodes: int = 120, edges: int = 300, seed: int = 3) -> dict[str, torch.Tensor]:
    """A community graph's features and labels with ~2.5 random in-edges per node (some nodes with
    none, some with a self-loop), so three hops from a mini-batch reach only part of it."""
    graph = community_graph(nodes=nodes, seed=seed)
    graph["edge_index"] = torch.randint(0, nodes, (2, edges), generator=torch.Generator().manual_seed(seed))
    return graph


GRAPH = _sparse_graph()
NODES = GRAPH["x"].shape[0]
TRAIN = GRAPH["train_mask"].nonzero().squeeze(1)


def _sampler(norm: str, fanouts: list[int], batch_size: int = 8, seed: int = 0) -> NeighbourSampler:
    edges, weight = edge_weights(GRAPH["edge_index"], NODES, norm)
    fields = {"x": GRAPH["x"], "labels": GRAPH["y"]}
    return NeighbourSampler(in_edges(edges, weight, NODES), TRAIN, fields, batch_size, fanouts, seed)


def _loss_and_grads(model, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    out = NodeClassificationTask()(model, batch)
    loss = out.loss_sum / out.loss_units
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layer", ["gcn", "sage", "gcnii"])
def test_full_fanout_mini_batch_equals_full_graph_restricted_to_its_targets(layer):
    model = tiny_gnn(layer, layers=3, graph=GRAPH)
    sampler = _sampler(model.config.neighbour_norm, [-1, -1, -1])
    edges, weight = edge_weights(GRAPH["edge_index"], NODES, model.config.neighbour_norm)
    sampled = copy.deepcopy(model)
    assert apply_block_sampling(sampled, sampled.parallel_plan()) == 3
    for batch in itertools.islice(iter(sampler), 3):
        targets = torch.zeros(NODES, dtype=torch.bool)
        targets[batch["targets"]] = True
        whole = {"x": GRAPH["x"], "labels": split_labels(GRAPH["y"], targets), "edge_index": edges,
                 "edge_weight": weight}
        want_loss, want_grads = _loss_and_grads(model, whole)
        got_loss, got_grads = _loss_and_grads(sampled, batch)
        assert batch["block_sizes"][0] < NODES  # three hops do not reach the whole graph: a real sub-graph
        assert_scalar_parity(got_loss, want_loss, f"{layer} mini-batch loss")
        assert_grads_parity(got_grads, want_grads, f"{layer} mini-batch")


def _true_in_edges(norm: str) -> dict[int, dict[int, float]]:
    """destination -> {source: normalised full-graph weight}, read off the edge list one by one."""
    edges, weight = edge_weights(GRAPH["edge_index"], NODES, norm)
    into: dict[int, dict[int, float]] = {t: {} for t in range(NODES)}
    for (s, t), w in zip(edges.T.tolist(), weight.tolist()):
        into[t][s] = w
    return into


@pytest.mark.parametrize("norm,fanouts", [("gcn", [3, 2]), ("mean", [2, -1, 4])])
def test_blocks_follow_the_definition_of_neighbour_sampling(norm, fanouts):
    into = _true_in_edges(norm)
    sampler = _sampler(norm, fanouts, seed=5)
    batches = list(sampler)
    sizes = [b["targets"].numel() for b in batches]
    assert len(sizes) == -(-TRAIN.numel() // 8) and max(sizes) <= 8 and max(sizes) - min(sizes) <= 1
    assert sorted(torch.cat([b["targets"] for b in batches]).tolist()) == TRAIN.tolist()  # each target once
    for batch in batches:
        sizes = batch["block_sizes"].tolist()
        assert batch["nodes"][:sizes[-1]].tolist() == batch["targets"].tolist()
        assert_parity(batch["x"], GRAPH["x"][batch["nodes"]], "input features")
        for layer, fanout in enumerate(reversed(fanouts)):
            src_nodes = batch["nodes"][:sizes[layer]].tolist()  # destinations first: a prefix
            dst_nodes = src_nodes[:sizes[layer + 1]]
            local = batch[f"block{layer}_edge_index"].T.tolist()
            picked: dict[int, list[int]] = {t: [] for t in dst_nodes}
            weights: dict[tuple[int, int], float] = {}
            for (s, t), w in zip(local, batch[f"block{layer}_edge_weight"].tolist()):
                picked[dst_nodes[t]].append(src_nodes[s])
                weights[src_nodes[s], dst_nodes[t]] = w
            for t, sources in picked.items():
                degree = len(into[t])
                want = degree if fanout == -1 else min(fanout, degree)
                assert len(sources) == want and len(set(sources)) == want, (t, sources, degree)
                assert set(sources) <= set(into[t])
                for s in sources:
                    assert weights[s, t] == pytest.approx(into[t][s] * degree / want, rel=1e-6)
            needed = set(dst_nodes) | {s for sources in picked.values() for s in sources}
            assert set(src_nodes) == needed and len(src_nodes) == len(needed)
    again = list(_sampler(norm, fanouts, seed=5))
    other = list(_sampler(norm, fanouts, seed=6))
    assert all(_same(a, b) for a, b in zip(batches, again))
    assert not all(_same(a, b) for a, b in zip(batches, other))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sampling_visits_every_neighbour():
    """Without replacement, but not always the same ones: over many mini-batches each in-neighbour
    of a node with more than ``fanout`` of them is drawn."""
    into = _true_in_edges("mean")
    hub = max(TRAIN.tolist(), key=lambda t: len(into[t]))
    edges, weight = edge_weights(GRAPH["edge_index"], NODES, "mean")
    sampler = NeighbourSampler(in_edges(edges, weight, NODES), torch.tensor([hub]), {"x": GRAPH["x"]}, 1, [2], seed=0)
    drawn = set()
    for batch in itertools.islice(itertools.chain.from_iterable(sampler for _ in range(60)), 60):
        drawn |= set(batch["nodes"][1:].tolist()) | ({hub} if 0 in batch["block0_edge_index"][0].tolist() else set())
    assert len(into[hub]) > 2 and drawn == set(into[hub])


def test_resume_mid_epoch_gives_the_same_remaining_mini_batches():
    straight = _sampler("gcn", [3, 2], batch_size=5, seed=2)
    stream = itertools.chain.from_iterable(straight for _ in range(2))
    uninterrupted = list(itertools.islice(stream, 2 * len(straight)))
    first = _sampler("gcn", [3, 2], batch_size=5, seed=2)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    assert state == {"epoch": 0, "position": 3}
    resumed = _sampler("gcn", [3, 2], batch_size=5, seed=2)
    resumed.load_state_dict(state)
    rest = list(resumed) + list(resumed)
    assert resumed.state_dict() == {"epoch": 2, "position": 0}
    assert len(rest) == len(uninterrupted) - 3
    assert all(_same(a, b) for a, b in zip(rest, uninterrupted[3:]))
    assert not torch.equal(uninterrupted[0]["targets"], uninterrupted[len(straight)]["targets"])  # a new order


@pytest.mark.parametrize("batch_size,fanouts,needle", [(0, [2], "batch_size"), (4, [], "fanouts"),
                                                       (4, [2, 0], "fanouts"), (4, [-2], "fanouts")])
def test_bad_sampling_options_are_refused(batch_size, fanouts, needle):
    with pytest.raises(BadConfig, match=needle):
        _sampler("gcn", fanouts, batch_size=batch_size)


def test_a_model_deeper_than_the_sampled_hops_is_told_so():
    model = tiny_gnn("sage", layers=3, graph=GRAPH)
    apply_block_sampling(model, model.parallel_plan())
    batch = next(iter(_sampler("mean", [2, 2])))
    with pytest.raises(RuntimeError, match="block2_edge_index"):
        model(batch["x"], batch)
