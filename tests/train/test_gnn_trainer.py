"""The GNN family through the real trainer, from a graph folder on disk: graph parallelism and
one-chunk GNNPipe equal one process step by step; chunked GNNPipe reports its eval metrics and
pipeline bytes and resumes from a checkpoint; bad graphs and layouts fail at launch."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.graph_utils import community_graph, write_raw
from tests.parity_utils import assert_series_parity
from veomni.config.load import dump_config
from veomni.config.schema import (
    CheckpointConfig,
    DataConfig,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from veomni.data.graph.format import GraphData, save_graph
from veomni.train.trainer import Trainer

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

NODES, CLASSES, FEATURES, LAYERS = 60, 3, 8, 4


def _graph_data(**changes) -> GraphData:
    """A community graph whose nodes outside the training set split into val and test."""
    graph = community_graph(NODES, CLASSES, FEATURES, seed=1)
    rest = ~graph["train_mask"]
    val = rest & (torch.arange(NODES) % 2 == 0)
    fields = dict(x=graph["x"], y=graph["y"], edge_index=graph["edge_index"], train_mask=graph["train_mask"],
                  val_mask=val, test_mask=rest & ~val)
    return GraphData(**{**fields, **changes}, num_classes=CLASSES, name="community")


def _config(tmp: str, pp: int = 1, grad_accum: int = 1, steps: int = 3, save_every: int = 0, **data) -> RunConfig:
    folder = str(Path(tmp).parent / "graph")
    model = dict(layer="gcnii", in_features=FEATURES, hidden_size=16, num_classes=CLASSES, num_layers=LAYERS,
                 dropout=0.0)
    return RunConfig(
        model=ModelConfig(arch="gnn", options=model),
        data=DataConfig(kind="graph", train_path=folder, eval_path=folder, graph_partitioner="bfs", **data),
        parallel=ParallelConfig(pp=pp),
        train=TrainConfig(output_dir=str(Path(tmp) / "out"), max_steps=steps, grad_accum=grad_accum, seed=3,
                          lr=0.05, warmup_steps=0, optimizer="sgd", max_grad_norm=0.0, eval_interval=2,
                          eval_batches=1, device="cpu"),
        checkpoint=CheckpointConfig(interval=save_every, keep_last=5),
        log=LogConfig(progress_bar=False),
    )


def _train(rank, world, tmp, pp, grad_accum, steps, data):
    return Trainer(_config(tmp, pp, grad_accum, steps, **data)).train()


def _losses(history):
    return [m["loss"] for m in history if "loss" in m]


@pytest.fixture(scope="module")
def graph_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gnn")
    save_graph(root / "graph", _graph_data())
    return root


@pytest.fixture(scope="module")
def reference(graph_dir):
    return run_distributed(_train, 1, str(graph_dir / "ref"), 1, 1, 3, {})[0]


@pytest.mark.parametrize("pp", [1, 2], ids=["graph-parallel-2", "gnnpipe-pp2-one-chunk"])
def test_two_ranks_equal_one_process(graph_dir, reference, pp):
    """pp=1: two graph partitions (FSDP over them, halos exchanged); pp=2: two stages over the
    whole graph as one chunk. Same per-step losses and eval metrics as one process (SGD)."""
    for history in run_distributed(_train, 2, str(graph_dir / f"pp{pp}"), pp, 1, 3, {}):
        assert_series_parity(_losses(history), _losses(reference), "losses")
        evals = [m for m in history if "eval_accuracy" in m]
        expected = [m for m in reference if "eval_accuracy" in m]
        assert_series_parity([m["eval_loss"] for m in evals], [m["eval_loss"] for m in expected], "eval losses")
        assert [m["eval_test_accuracy"] for m in evals] == [m["eval_test_accuracy"] for m in expected]
        assert ("comm_bytes_graph_halo" in history[0]) == (pp == 1)


CHUNKED = dict(graph_warmup_epochs=1, graph_refresh_every=2)


def _stop_after(rank, world, tmp, steps):
    trainer = Trainer(_config(tmp, 2, 3, 5, steps, **CHUNKED))
    for _ in range(steps):  # checkpoint.interval=steps saves after the last; the run then "dies"
        trainer.run_step()
    trainer.checkpoints.wait()


def _resume(rank, world, tmp, steps):
    trainer = Trainer(_config(tmp, 2, 3, 5, steps, **CHUNKED))
    start = trainer.step
    return start, trainer.train()


def test_chunked_gnnpipe_reports_metrics_and_resumes(graph_dir):
    """pp=2 with 3 chunks: epoch 0 is exact (warm-up), odd epochs run the chunks against the
    histories, even ones refresh them with the whole graph. The histories are not checkpointed,
    so a run resumed after step 2 (before the refresh epoch 2, which rewrites every history row
    before any chunk reads one) repeats the uninterrupted losses exactly; resumed after step 3,
    epoch 3 (chunked in the uninterrupted run) runs exact to refill the histories, so its loss
    differs, but stays finite."""
    full = run_distributed(_train, 2, str(graph_dir / "full"), 2, 3, 5, CHUNKED)[-1]
    assert all(math.isfinite(loss) for loss in _losses(full))
    assert all(m["comm_bytes_pp_p2p"] > 0 for m in full if "loss" in m)
    evals = [m for m in full if "eval_accuracy" in m]
    assert len(evals) == 2  # steps 2 and 4 (the final eval goes to metrics.jsonl)
    assert all(0.0 <= m["eval_accuracy"] <= 1.0 and 0.0 <= m["eval_test_accuracy"] <= 1.0 for m in evals)

    for stop, exact in ((2, True), (3, False)):
        tmp = graph_dir / f"stop{stop}"
        run_distributed(_stop_after, 2, str(tmp), stop)
        start, history = run_distributed(_resume, 2, str(tmp), stop)[-1]
        assert start == stop
        losses = _losses(history)
        assert len(losses) == 5 - stop and all(math.isfinite(loss) for loss in losses)
        if exact:
            assert_series_parity(losses, _losses(full)[stop:], "resumed losses")
        else:
            assert losses[0] != pytest.approx(_losses(full)[stop], abs=1e-5)


def _recipe(tmp_path: Path, graph: Path) -> Path:
    cfg = _config(str(tmp_path / "run"))
    cfg.data.train_path = cfg.data.eval_path = str(graph)
    path = tmp_path / "recipe.yaml"
    path.write_text(dump_config(cfg))
    return path


@pytest.mark.parametrize("bad_edges, overrides, message", [
    (True, [], rf"2 edges point outside the {NODES} nodes"),
    (False, ["--model.in_features", "5"], f"set model.in_features: {FEATURES}"),
    (False, ["--parallel.pp", "2", "--parallel.pp_schedule", "Interleaved1F1B", "--train.grad_accum", "2"],
     "pipelines its graph chunks with GPipe or 1F1B"),
    (False, ["--parallel.sp", "2"], "graphs scale by partitions"),
], ids=["edge-past-nodes", "in-features", "interleaved", "sp"])
def test_launcher_rejects_bad_graphs_and_layouts(tmp_path, capsys, bad_edges, overrides, message):
    from veomni.launch import main

    if bad_edges:
        graph = community_graph(NODES, CLASSES, FEATURES, seed=1)
        edges = torch.cat([graph["edge_index"], torch.tensor([[0, NODES + 4], [NODES, 1]])], dim=1)
        folder = write_raw(tmp_path / "graph", _graph_data(edge_index=edges))
    else:
        folder = save_graph(tmp_path / "graph", _graph_data())
    assert main([str(_recipe(tmp_path, folder)), "--launcher-world-size", "2", *overrides]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "gnnpipe"
WORLD = {"tiny.yaml": 2, "stdlib_gcnii.yaml": 2, "paper_scale.yaml": 8}
"""Each GNNPipe recipe's intended world size (its header says how to run it)."""


@pytest.mark.parametrize("name", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_gnnpipe_recipes_plan_with_dry_run(capsys, name):
    """Every recipe plans at its world size, with or without its graph built: the graph's size,
    the history per rank and the bytes per epoch of each mode."""
    from veomni.launch import main

    assert name in WORLD, f"add {name}'s world size to WORLD"
    assert main([str(RECIPES / name), "--dry-run", "--world-size", str(WORLD[name])]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^history +[\d.]+ GiB per rank", out, flags=re.M), out[-3000:]
    assert re.search(r"^bytes / epoch", out, flags=re.M) and re.search(r"GNNPipe \(\d+ stages.*GiB", out)
    if name == "paper_scale.yaml":
        nodes = int(re.search(r"^graph +([\d,]+) nodes", out, flags=re.M).group(1).replace(",", ""))
        assert 232_965 <= nodes < 232_965 + 32, "32 chunks of ceil(232,965 / 32) nodes"
        assert "8 stage(s), 32 chunk(s) per epoch" in out
