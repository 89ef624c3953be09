"""Sampled mini-batch GNN training through the real trainer (``data.graph_fanouts``): two gloo
ranks, each sampling around its own partition's targets, equal one process that trains on both
ranks' mini-batches (per-step losses, SGD); cross-partition reads in the metrics; a run resumed
mid-epoch repeats the uninterrupted losses bit for bit; the launcher refuses bad options."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from harness.gloo_ranks import run_distributed
from models.gnn import GNNConfig, GNNModel
from tests.graph_utils import community_graph
from tests.parity_utils import assert_series_parity
from veomni.config.load import dump_config
from veomni.config.schema import CheckpointConfig, DataConfig, LogConfig, ModelConfig, RunConfig, TrainConfig
from veomni.data.graph.format import GraphData, save_graph
from veomni.data.graph.sampled import SampledGraphDataset
from veomni.data.kinds import STEP_STATS, DatasetRequest
from veomni.parallel.graph.aggregation import apply_block_sampling
from veomni.tasks import NodeClassificationTask
from veomni.train.trainer import Trainer

pytestmark = pytest.mark.full  # multi-rank trainers: the full tier (tests/conftest.py)

NODES, CLASSES, FEATURES, SEED, LR = 80, 3, 8, 5, 0.2
MODEL = dict(layer="sage", in_features=FEATURES, hidden_size=16, num_classes=CLASSES, num_layers=2, dropout=0.0)


CACHED = dict(graph_features="mmap", graph_cache_rows=12, graph_cache_policy="lru", graph_batch_order="proximity")
"""The feature path of the two-rank test: memory-mapped, cached, in proximity order."""


def _config(tmp: str, steps: int, save_every: int = 0, **data) -> RunConfig:
    folder = str(Path(tmp).parent / "graph")
    return RunConfig(
        model=ModelConfig(arch="gnn", options=dict(MODEL)),
        data=DataConfig(kind="graph", train_path=folder, eval_path=folder, graph_partitioner="bfs",
                        graph_fanouts=[3, 2], graph_batch_size=8, **data),
        train=TrainConfig(output_dir=str(Path(tmp) / "out"), max_steps=steps, seed=SEED, lr=LR, warmup_steps=0,
                          min_lr_ratio=1.0, weight_decay=0.0, optimizer="sgd", max_grad_norm=0.0, eval_interval=2,
                          eval_batches=0, device="cpu"),
        checkpoint=CheckpointConfig(interval=save_every, keep_last=5),
        log=LogConfig(progress_bar=False),
    )


def _val_mask() -> torch.Tensor:
    return ~community_graph(NODES, CLASSES, FEATURES, seed=4)["train_mask"] & (torch.arange(NODES) % 2 == 0)


@pytest.fixture(scope="module")
def graph_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampled")
    graph = community_graph(NODES, CLASSES, FEATURES, seed=4)
    rest, val = ~graph["train_mask"], _val_mask()
    save_graph(root / "graph", GraphData(x=graph["x"], y=graph["y"], edge_index=graph["edge_index"],
                                         train_mask=graph["train_mask"], val_mask=val, test_mask=rest & ~val,
                                         num_classes=CLASSES))
    return root


def _train(rank, world, tmp, steps, save_every=0, data=None):
    return Trainer(_config(tmp, steps, save_every, **(data or {}))).train()


def _one_process(graph_dir: Path, steps: int) -> tuple[list[float], list[float]]:
    """Both ranks' mini-batches, built here, trained on by one model: the loss of a step is the sum
    over both ranks' labelled targets divided by their count. Returns (losses, remote rows)."""
    cfg = _config(str(graph_dir / "ref"), steps, **CACHED)
    model_config = GNNConfig(**MODEL)
    torch.manual_seed(SEED)  # the trainer's seeded init on rank 0
    model = GNNModel(model_config)
    model.init_weights()
    apply_block_sampling(model, model.parallel_plan(), 2)
    streams = [iter(SampledGraphDataset(DatasetRequest(cfg.data, cfg.data.train_path, "train", None, rank, 2, SEED,
                                                       model_config, 1))) for rank in (0, 1)]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, remote = [], []
    for _ in range(steps):
        batches = [next(stream) for stream in streams]
        outputs = [NodeClassificationTask()(model, batch) for batch in batches]
        loss = sum(out.loss_sum for out in outputs) / sum(out.loss_units for out in outputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        remote.append(sum(batch[STEP_STATS]["cross_partition_rows"] for batch in batches))
    return losses, remote


def _losses(history):
    return [m["loss"] for m in history if "loss" in m]


def test_two_ranks_sampling_their_partitions_equal_one_process(graph_dir):
    want, remote = _one_process(graph_dir, 4)
    histories = run_distributed(_train, 2, str(graph_dir / "two"), 4, 0, CACHED)
    for history in histories:
        assert_series_parity(_losses(history), want, "per-step losses")
        assert [m["cross_partition_rows"] for m in history] == remote
        assert all(0 < m["cross_partition_fraction"] < 1 for m in history)
        assert history[0]["feature_cache_hit_rate"] == 0  # the first mini-batch finds the cache empty
        assert all(0 < m["feature_cache_hit_rate"] < 1 and m["feature_load_s"] > 0 for m in history[1:])
        assert all(0 <= m["data_wait_fraction"] <= 1 and m["data_wait_s"] >= 0 for m in history)
        for m in history:  # misses are read from the memory map, F float32 each
            misses = m["sampled_feature_rows"] * (1 - m["feature_cache_hit_rate"])
            assert m["feature_bytes_read"] == pytest.approx(misses * FEATURES * 4)
        evals = [m for m in history if "eval_accuracy" in m]
        assert len(evals) == 2 and all(0 <= m["eval_test_accuracy"] <= 1 for m in evals)
        assert all(m["eval_loss_nodes"] == int(_val_mask().sum()) for m in evals)  # every validation node
    held_out = NODES - int(community_graph(NODES, CLASSES, FEATURES, seed=4)["train_mask"].sum())
    summary = json.loads((graph_dir / "two" / "out" / "summary.json").read_text())
    assert summary["eval_samples"] == held_out  # the eval's targets, not the input nodes of its blocks


def _stop_after(rank, world, tmp, steps):
    trainer = Trainer(_config(tmp, 5, save_every=steps))
    for _ in range(steps):  # the checkpoint at `steps` is mid-epoch: 3 mini-batches per epoch
        trainer.run_step()
    trainer.checkpoints.wait()


def _resume(rank, world, tmp):
    trainer = Trainer(_config(tmp, 5))
    return trainer.step, trainer.train()


def test_resume_mid_epoch_repeats_the_losses_bit_for_bit(graph_dir):
    straight = _losses(run_distributed(_train, 1, str(graph_dir / "straight"), 5)[0])
    tmp = str(graph_dir / "stopped")
    run_distributed(_stop_after, 1, tmp, 2)
    start, history = run_distributed(_resume, 1, tmp)[0]
    assert start == 2
    assert _losses(history) == straight[2:]


def _recipe(tmp_path: Path, graph_dir: Path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(dump_config(_config(str(graph_dir / "launch"), 2)))
    return path


@pytest.mark.parametrize("overrides, message", [
    (["--data.graph_fanouts", "[3]"], r"graph_fanouts has 1 entries, the model has 2 message-passing layers"),
    (["--data.graph_fanouts", "[3, 0]"], r"graph_fanouts=\[3, 0\]: each entry .* not 0"),
    (["--data.graph_batch_size", "0"], r"graph_batch_size=0"),
], ids=["hops", "zero-fanout", "batch-size"])
def test_launcher_refuses_bad_sampling_options(tmp_path, graph_dir, capsys, overrides, message):
    from veomni.launch import main

    assert main([str(_recipe(tmp_path, graph_dir)), "--launcher-world-size", "2", *overrides]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
