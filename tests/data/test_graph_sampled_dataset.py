"""The ``graph`` kind with ``data.graph_fanouts`` (``veomni/data/graph/sampled.py``): each rank
samples around its own partition's training nodes, every rank takes the same number of
mini-batches, an epoch covers every training node once; eval gives each validation / test node of
the partition its exact full-graph output; the position resumes exactly; cross-partition reads are
counted; mini-batches made ahead on a thread are the same; the options are checked before any
worker starts."""

from __future__ import annotations

import copy
import itertools
import re
import time
from pathlib import Path

import pytest
import torch

from tests.graph_utils import community_graph, tiny_gnn
from tests.parity_utils import assert_parity
from veomni.config.schema import DataConfig
from veomni.contract.plan import ParallelPlan
from veomni.data.graph.dataset import build_graph_dataset
from veomni.data.graph.format import GraphData, save_graph
from veomni.data.graph.partition import partition_nodes
from veomni.data.graph.prefetch import Prefetcher
from veomni.data.graph.sampled import SampledGraphDataset
from veomni.data.graph.source import sampling_problems
from veomni.data.graph.views import edge_weights
from veomni.data.kinds import STEP_STATS, DatasetRequest
from veomni.errors import BadConfig
from veomni.parallel.graph.aggregation import apply_block_sampling, block_sampling_problems
from veomni.tasks import NodeClassificationTask
from veomni.tasks.base import count_samples

NODES, SEED, BATCH = 90, 7, 6


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    graph = community_graph(NODES, classes=3, features=8, seed=2)
    rest = ~graph["train_mask"]
    val = rest & (torch.arange(NODES) % 2 == 0)
    data = GraphData(x=graph["x"], y=graph["y"], edge_index=graph["edge_index"], train_mask=graph["train_mask"],
                     val_mask=val, test_mask=rest & ~val, num_classes=3)
    return save_graph(tmp_path_factory.mktemp("sampled") / "graph", data), data


def _dataset(folder, split="train", rank=0, ranks=2, fanouts=(3, 2), norm="mean", batch=BATCH,
             order="random") -> SampledGraphDataset:
    cfg = DataConfig(kind="graph", train_path=str(folder), eval_path=str(folder), graph_partitioner="bfs",
                     graph_fanouts=list(fanouts), graph_batch_size=batch, graph_batch_order=order)
    model = type("M", (), {"in_features": 8, "num_classes": 3, "neighbour_norm": norm})()
    return build_graph_dataset(DatasetRequest(cfg, str(folder), split, None, rank, ranks, SEED, model, 1))


def _owner(data: GraphData, ranks: int = 2) -> torch.Tensor:
    return partition_nodes(data.edge_index, NODES, ranks, "bfs", SEED)


def test_each_rank_samples_its_own_partition_and_an_epoch_covers_every_training_node(folder):
    path, data = folder
    owner = _owner(data)
    datasets = [_dataset(path, rank=r) for r in (0, 1)]
    assert isinstance(datasets[0], SampledGraphDataset)
    per_rank = torch.bincount(owner[data.train_mask], minlength=2)
    assert per_rank.min() != per_rank.max()  # uneven partitions: the smaller one's batches are smaller
    assert datasets[0].batches == datasets[1].batches == -(-int(per_rank.max()) // BATCH)
    largest = int(per_rank.max())  # one target more than the other partition holds: 2 mini-batches on both
    assert [_dataset(path, rank=r, batch=largest - 1).batches for r in (0, 1)] == [2, 2]
    seen = []
    for rank, ds in enumerate(datasets):
        epoch = list(itertools.islice(iter(ds), ds.batches))
        for batch in epoch:
            assert (owner[batch["targets"]] == rank).all() and 0 < batch["targets"].numel() <= BATCH
            remote = int((owner[batch["nodes"]] != rank).sum())
            stats = batch[STEP_STATS]
            assert stats["sampled_feature_rows"] == batch["nodes"].numel()
            assert stats["cross_partition_rows"] == remote
            assert list(stats["cross_partition_fraction"]) == [remote, batch["nodes"].numel()]
            assert_parity(batch["x"], data.x[batch["nodes"]], "features of the input nodes")
        seen += [t for batch in epoch for t in batch["targets"].tolist()]
    assert sorted(seen) == data.train_mask.nonzero()[:, 0].tolist()
    assert sum(b[STEP_STATS]["cross_partition_rows"] for b in itertools.islice(iter(_dataset(path)), 4)) > 0


def test_eval_gives_held_out_nodes_their_full_graph_outputs(folder):
    path, data = folder
    owner = _owner(data)
    model = tiny_gnn("sage", layers=2, graph={"x": data.x, "y": data.y})
    sampled = copy.deepcopy(model)
    apply_block_sampling(sampled, sampled.parallel_plan(), 2)
    edges, weight = edge_weights(data.edge_index, NODES, "mean")
    full = model(data.x, {"edge_index": edges, "edge_weight": weight})
    held_out = data.val_mask | data.test_mask
    for rank in (0, 1):
        targets = []
        for batch in _dataset(path, "eval", rank):
            assert_parity(sampled(batch["x"], batch), full[batch["targets"]], "eval logits")
            assert torch.equal(batch["labels"] >= 0, data.val_mask[batch["targets"]])
            assert torch.equal(batch["test_labels"] >= 0, data.test_mask[batch["targets"]])
            targets += batch["targets"].tolist()
        assert sorted(targets) == (held_out & (owner == rank)).nonzero()[:, 0].tolist()


def test_held_out_mini_batches_are_the_same_whatever_the_training_order(folder):
    """An eval of a few mini-batches scores the same held-out sample for every training order (a
    BFS-ordered eval would score a few neighbourhoods, another sample for each order)."""
    path, _ = folder
    shuffled = [b["targets"] for b in _dataset(path, "eval", batch=4)]
    proximity = [b["targets"] for b in _dataset(path, "eval", batch=4, order="proximity")]
    assert len(shuffled) > 1 and all(torch.equal(a, b) for a, b in zip(shuffled, proximity, strict=True))
    trained = [b["targets"] for b in itertools.islice(_dataset(path, batch=4, order="proximity"), 4)]
    shuffled_training = [b["targets"] for b in itertools.islice(_dataset(path, batch=4), 4)]
    assert not all(torch.equal(a, b) for a, b in zip(trained, shuffled_training))  # training keeps its order


def test_a_sampled_mini_batch_counts_its_targets_as_samples_a_full_graph_batch_its_nodes(folder):
    path, _ = folder
    contract = NodeClassificationTask().contract
    batch = next(iter(_dataset(path, "eval")))
    assert count_samples(batch, contract) == batch["targets"].numel() < contract.row_length(batch)
    whole = next(iter(_dataset(path, "eval", fanouts=())))
    assert count_samples(whole, contract) == contract.row_length(whole) == whole["x"].shape[0]


def test_a_resumed_dataset_yields_the_same_next_mini_batches(folder):
    path, _ = folder
    straight = list(itertools.islice(iter(_dataset(path, rank=1)), 10))
    first = _dataset(path, rank=1)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    resumed = _dataset(path, rank=1)
    resumed.load_state_dict(state)
    for got, want in zip(itertools.islice(iter(resumed), 6), straight[4:]):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in got if k != STEP_STATS)
    other = _dataset(path, rank=1, ranks=3)
    with pytest.raises(BadConfig, match="epoch boundary"):
        other.load_state_dict({**state, "index": 1})
    assert SampledGraphDataset.merge_positions([state, {**state, "epoch": 0}]) == {"epoch": 0}


@pytest.mark.parametrize("fanouts,size,sequences,needle", [([3, 0], 4, 1, "not 0"), ([-2], 4, 1, "not -2"),
                                                           ([3], 0, 1, "graph_batch_size=0"),
                                                           ([3], 4, 0, "graph_order_sequences=0")])
def test_bad_sampling_options_are_named(fanouts, size, sequences, needle):
    problems = sampling_problems(DataConfig(graph_fanouts=fanouts, graph_batch_size=size,
                                            graph_order_sequences=sequences))
    assert len(problems) == 1 and needle in problems[0]


def test_fanouts_must_match_the_message_passing_layers_and_no_pipeline():
    model = tiny_gnn("sage", layers=3)
    plan = model.parallel_plan()
    assert block_sampling_problems(model, plan, 3, 1) == []
    assert "3 message-passing layers" in block_sampling_problems(model, plan, 2, 1)[0]
    assert "parallel.pp: 1" in block_sampling_problems(model, plan, 3, 2)[0]
    assert "no message-passing layers" in block_sampling_problems(model, ParallelPlan(), 3, 1)[0]
    with pytest.raises(BadConfig, match="give one fanout per layer"):
        apply_block_sampling(model, plan, 4)


def test_mini_batches_made_ahead_on_a_thread_are_the_ones_made_in_the_step(folder):
    path, _ = folder
    cfgs = {depth: _dataset(path, rank=1) for depth in (0, 3)}
    for depth, ds in cfgs.items():
        ds.prefetch = depth
    inline, ahead = (list(itertools.islice(iter(cfgs[d]), 7)) for d in (0, 3))
    for got, want in zip(ahead, inline):
        assert all(torch.equal(got[k], want[k]) for k in got if k != STEP_STATS)
        waited, step = got[STEP_STATS]["data_wait_fraction"]
        assert 0 <= waited <= step and got[STEP_STATS]["data_wait_s"] == waited


def test_the_thread_overlaps_the_consumer_and_hands_over_its_errors():
    def make(position: int) -> int:
        time.sleep(0.02)
        if position == 4:
            raise ValueError("bad position 4")
        return position

    ahead = Prefetcher(make, iter(range(10)), 2)
    waits = []
    for expected in range(4):
        started = time.perf_counter()
        assert ahead.get() == expected
        waits.append(time.perf_counter() - started)
        time.sleep(0.15)  # the consumer's step: the next one is made meanwhile
    assert sum(waits[1:]) < 0.15, waits
    with pytest.raises(ValueError, match="bad position 4"):
        ahead.get()
    ahead.close()


def test_dry_run_plans_a_products_sized_sampled_recipe(capsys):
    from veomni.launch import main
    from veomni.planner.sampled_plan import input_nodes

    assert input_nodes(10, [3, -1], 1000, 4.0) == [10, 40, 200] and input_nodes(10, [50], 100, 8.0) == [10, 90]
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "bgl" / "products_sage_sampled.yaml"
    assert main([str(recipe), "--dry-run", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "1,024 -> 16,384 -> 180,224 -> 1,081,344" in out  # products' degree ~51.5: min(f, D) per hop
    rows = 299 * 8 * 1_081_344 * 400 / 2**30  # ceil(2,449,032 / 8 / 1,024) mini-batches per rank
    assert f"no cache: {rows:.3f} GiB" in out
    assert re.search(r"features \(mmap: pages read only\) +0\.000 GiB", out)
