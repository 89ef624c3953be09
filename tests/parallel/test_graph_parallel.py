"""Graph parallelism, GNNPipe layer pipelining and their hybrid against one process, on real gloo
ranks: with one chunk every mode computes the full-graph loss and gradients exactly; with
several chunks the pipeline computes exactly what chunked training with histories computes in
one process; and the bytes each mode sends match their formulas."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from harness.gloo_ranks import run_distributed
from tests.graph_utils import (
    chunked_reference,
    community_graph,
    named_grads,
    reference_grads,
    tiny_gnn,
    train_units,
    views,
)
from tests.parity_utils import assert_grads_parity, assert_parity, assert_scalar_parity, assert_series_parity
from veomni.parallel.comm_counter import COMM_COUNTER
from veomni.parallel.graph.halo import apply_graph_parallel
from veomni.parallel.graph.layer_pipeline import GraphPipeline, schedule_actions
from veomni.parallel.pipeline.stages import cut_stage
from veomni.tasks import NodeClassificationTask

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

LAYERS = 4


def _stage(model, stage: int, stages: int, group):
    counts = [LAYERS // stages] * stages
    part = cut_stage(copy.deepcopy(model), stage, counts)
    apply_graph_parallel(part, model.parallel_plan(), group)
    return part


def _graph_parallel(rank: int, world: int, layer: str):
    graph = community_graph()
    model = tiny_gnn(layer, LAYERS, graph=graph)
    apply_graph_parallel(model, model.parallel_plan(), dist.group.WORLD)
    _, whole = views(graph, model, world, rank, 1)
    with COMM_COUNTER.measure() as counter:
        out = NodeClassificationTask()(model, whole)
        (out.loss_sum / train_units(graph)).backward()
        sent = counter.bytes["graph_halo"]
    loss = out.loss_sum.detach() / train_units(graph)
    dist.all_reduce(loss)
    grads = named_grads(model)
    for grad in grads.values():
        dist.all_reduce(grad)
    rows = int(whole["send_counts"].sum() + whole["recv_counts"].sum())
    return float(loss), grads, sent, rows


@pytest.mark.parametrize("layer", ["gcnii", "sage"])
@pytest.mark.parametrize("world", [2, 4])
def test_graph_parallel_equals_one_process(world, layer):
    graph = community_graph()
    ref_loss, ref_grads = reference_grads(tiny_gnn(layer, LAYERS, graph=graph), graph)
    for loss, grads, sent, rows in run_distributed(_graph_parallel, world, layer):
        assert_scalar_parity(loss, ref_loss, "loss")
        assert_grads_parity(grads, ref_grads, "graph parallel")
        # every layer sends the rows others need forward, and the gradients of the rows it
        # received back: L (sent + received rows) d 4 bytes
        assert sent == LAYERS * rows * 16 * 4


def _pipeline(rank: int, world: int, schedule: str, chunks: int, epochs: int, stale_gradients: bool = False):
    graph = community_graph()
    model = tiny_gnn("gcnii", LAYERS, graph=graph)
    part = _stage(model, rank, world, None)
    pipeline = GraphPipeline(part, rank, world, schedule, dist.group.WORLD, torch.device("cpu"),
                             NodeClassificationTask())
    chunk_views, whole = views(graph, model, 1, 0, chunks, stale_gradients)
    batch = [whole] if chunks == 1 else chunk_views
    optimizer = torch.optim.SGD(part.parameters(), lr=0.1)
    losses, grads, sent = [], None, 0
    for _ in range(epochs):
        with COMM_COUNTER.measure() as counter:
            results = pipeline.step(batch, 1 / train_units(graph))
            sent = counter.bytes["pp_p2p"]
        losses.append(sum(float(r.loss_sum) for r in results) / train_units(graph))
        grads = grads or named_grads(part)
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, sent


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("world", [2, 4])
def test_one_chunk_pipeline_equals_one_process(world, schedule):
    graph = community_graph()
    ref_loss, ref_grads = reference_grads(tiny_gnn("gcnii", LAYERS, graph=graph), graph)
    results = run_distributed(_pipeline, world, schedule, 1, 1)
    assert_scalar_parity(results[-1][0][0], ref_loss, "loss")
    grads = {name: g for _, stage_grads, _ in results for name, g in stage_grads.items()}
    assert_grads_parity(grads, ref_grads, "graph parallel")
    nodes = graph["x"].shape[0]
    for rank, (_, _, sent) in enumerate(results):
        # the GCNII state (h, h0) of every node crosses each stage boundary forward, its gradient back
        boundaries = (rank < world - 1) + (rank > 0)
        assert sent == boundaries * nodes * 2 * 16 * 4


@pytest.mark.parametrize("stale_gradients", [False, True])
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_chunked_pipeline_equals_chunked_training_in_one_process(schedule, stale_gradients):
    """Over 4 epochs (stale gradients are delivered from the second on), whatever order the
    schedule runs the chunks' backward in."""
    graph = community_graph()
    expected = chunked_reference(tiny_gnn("gcnii", LAYERS, graph=graph), graph, chunks=3, epochs=4,
                                 stale_gradients=stale_gradients)
    losses = run_distributed(_pipeline, 2, schedule, 3, 4, stale_gradients)[-1][0]
    assert_series_parity(losses, expected, "losses")
    # and the history matters: the stale epochs differ from exact full-graph training
    ref_loss, _ = reference_grads(tiny_gnn("gcnii", LAYERS, graph=graph), graph)
    assert losses[0] != pytest.approx(ref_loss, abs=1e-4)


def test_stale_gradients_reach_the_rows_stale_edges_read():
    """The first two epochs' losses are the same with and without (the first epoch only collects,
    so the first update is the same); the gradients delivered in the second change the next."""
    graph = community_graph()
    model = tiny_gnn("gcnii", LAYERS, graph=graph)
    without = chunked_reference(model, graph, chunks=3, epochs=6)
    with_grads = chunked_reference(model, graph, chunks=3, epochs=6, stale_gradients=True)
    assert_series_parity(with_grads[:2], without[:2], "first two epochs")
    assert with_grads[2] != pytest.approx(without[2], abs=1e-5)


def _hybrid(rank: int, world: int):
    stages, parts = 2, world // 2
    stage, part_rank = rank % stages, rank // stages
    pp_groups = [dist.new_group([p * stages + s for s in range(stages)]) for p in range(parts)]
    dp_groups = [dist.new_group([p * stages + s for p in range(parts)]) for s in range(stages)]
    graph = community_graph()
    model = tiny_gnn("gcnii", LAYERS, graph=graph)
    part = _stage(model, stage, stages, dp_groups[stage])
    pipeline = GraphPipeline(part, stage, stages, "1F1B", pp_groups[part_rank], torch.device("cpu"),
                             NodeClassificationTask())
    _, whole = views(graph, model, parts, part_rank, 1)
    results = pipeline.step([whole], 1 / train_units(graph))
    loss = torch.tensor(sum(float(r.loss_sum) for r in results) / train_units(graph))
    dist.all_reduce(loss)
    grads = named_grads(part)
    for grad in grads.values():
        dist.all_reduce(grad, group=dp_groups[stage])
    return float(loss), grads


def test_hybrid_pipeline_by_partitions_equals_one_process():
    graph = community_graph()
    ref_loss, ref_grads = reference_grads(tiny_gnn("gcnii", LAYERS, graph=graph), graph)
    results = run_distributed(_hybrid, 4)
    assert_scalar_parity(results[0][0], ref_loss, "loss")
    grads = {name: g for _, stage_grads in results for name, g in stage_grads.items()}
    assert_grads_parity(grads, ref_grads, "graph parallel")


def test_schedules_run_every_chunk_once_each_way():
    for schedule in ("GPipe", "1F1B"):
        for stages in (1, 2, 4):
            for stage in range(stages):
                actions = schedule_actions(schedule, stage, stages, 5)
                assert sorted(c for a, c in actions if a == "F") == list(range(5))
                assert sorted(c for a, c in actions if a == "B") == list(range(5))
                assert all(actions.index(("F", c)) < actions.index(("B", c)) for c in range(5))


def _fresh_history_forward(rank: int, world: int):
    """Logits of every chunk, read after one whole-view pass filled the histories: with
    unchanged weights every stale row is exact, so each chunk must give its full-graph logits."""
    graph = community_graph()
    model = tiny_gnn("gcnii", LAYERS, graph=graph)
    apply_graph_parallel(model, model.parallel_plan(), dist.group.WORLD if world > 1 else None)
    chunk_views, whole = views(graph, model, world, rank, 3)
    with torch.no_grad():
        full = model(whole["x"], whole)
        chunks = [model(view["x"], view) for view in reversed(chunk_views)]
    return full, torch.cat(list(reversed(chunks)))


@pytest.mark.parametrize("world", [1, 2])
def test_history_written_by_a_whole_pass_makes_chunks_exact(world):
    results = [_fresh_history_forward(0, 1)] if world == 1 else run_distributed(_fresh_history_forward, world)
    for full, chunked in results:
        assert any(view["stale_edge_index"].shape[1] for view in views(community_graph(), tiny_gnn(), world, 0, 3)[0])
        assert_parity(chunked, full, "chunked forward")
