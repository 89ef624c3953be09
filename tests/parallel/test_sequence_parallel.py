"""Ulysses sequence parallelism: sp=2 and sp=4 (and dp x sp = 2 x 2) give the losses,
gradients and updated parameters of one process, on packed rows whose samples straddle the
split points and whose lengths do not divide by the SP size; the all-to-all volume matches
its formula."""

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.parity_utils import TINY_LLM, assert_records_close, run_steps, sample_lengths, tiny_model
from veomni.config.schema import ParallelConfig
from veomni.data.packing import pack_samples
from veomni.parallel.comm_counter import COMM_COUNTER
from veomni.parallel.mesh import LayoutError, ParallelDims, build_mesh
from veomni.parallel.row_split import RowSplit, shard_batch
from veomni.parallel.sequence import check_sequence_parallel, kv_repeat_factor
from veomni.tasks import LM_CONTRACT

STEPS = [sample_lengths(7, seed=20), sample_lengths(5, seed=21)]  # 2 steps, odd total lengths


def _run(rank, world, parallel, dp_world):
    dp_rank = rank // parallel.sp if dp_world > 1 else 0
    return run_steps([[samples[dp_rank::dp_world]] for samples in STEPS], parallel)


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_run, 1, ParallelConfig(), 1)[0]


def test_rows_are_not_divisible_by_sp():
    totals = [pack_samples(s)["input_ids"].numel() for s in STEPS]
    assert any(t % 4 for t in totals) and any(t % 2 for t in totals)


@pytest.mark.parametrize("world, parallel, dp_world", [
    (2, ParallelConfig(sp=2), 1),
    (4, ParallelConfig(sp=4), 1),  # 2 K/V heads < sp=4: K/V heads repeated
    (4, ParallelConfig(sp=2), 2),  # dp_shard=2 x sp=2
    (4, ParallelConfig(sp=2, dp_replicate=2), 2),
    (2, ParallelConfig(sp=2, activation_checkpointing="full"), 1),
], ids=["sp2", "sp4-gqa", "dp2xsp2", "hsdp2xsp2", "sp2-ac"])
def test_sequence_parallel_matches_single_process(reference, world, parallel, dp_world):
    for got in run_distributed(_run, world, parallel, dp_world):
        assert_records_close(reference, got)


def test_shard_batch_pads_and_keeps_global_boundaries():
    batch = pack_samples([[1, 2, 3], [4, 5, 6, 7, 8]])  # T = 8 -> sp=3 pads to 9
    parts = [shard_batch(batch, RowSplit(sp_rank=r, sp=3), LM_CONTRACT) for r in range(3)]
    assert [p["input_ids"].tolist() for p in parts] == [[1, 2, 3], [4, 5, 6], [7, 8, 0]]
    assert [p["position_ids"].tolist() for p in parts] == [[0, 1, 2], [0, 1, 2], [3, 4, 0]]
    assert parts[2]["labels"].tolist() == [8, -100, -100]
    assert all(torch.equal(p["cu_seqlens"], batch["cu_seqlens"]) for p in parts)
    assert [p["valid_tokens"] for p in parts] == [3, 3, 2]  # leading real tokens: MoE routes only these
    short = pack_samples([[1, 2, 3, 4]])  # T = 4 -> sp=3 pads to 6: the last slice is all padding
    assert [shard_batch(short, RowSplit(sp_rank=r, sp=3), LM_CONTRACT)["valid_tokens"] for r in range(3)] == [2, 2, 0]


def _bytes_per_layer(rank, world):
    dims = ParallelDims.resolve(ParallelConfig(sp=world), world)
    meshes = build_mesh(dims, "cpu")
    from veomni.parallel.apply import parallelize

    model = parallelize(tiny_model(), ParallelConfig(sp=world), meshes, "cpu")
    batch = shard_batch(pack_samples(sample_lengths(6, seed=3)), meshes.row_split, LM_CONTRACT)
    with COMM_COUNTER.measure() as counter:
        model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], batch["max_seqlen"]).sum().backward()
    return counter.bytes["sp_all_to_all"], counter.calls["sp_all_to_all"], batch["input_ids"].numel()


@pytest.mark.parametrize("sp", [2, 4])
def test_all_to_all_bytes_match_the_formula(sp):
    sent, calls, local_tokens = run_distributed(_bytes_per_layer, sp)[0]
    heads, kv_heads, dim, layers = TINY_LLM["num_heads"], TINY_LLM["num_kv_heads"], TINY_LLM["head_dim"], \
        TINY_LLM["num_layers"]
    kv = kv_heads * kv_repeat_factor(heads, kv_heads, sp)
    # per layer, forward: q, k, v in and the output back; backward: the same four again.
    per_layer = 2 * local_tokens * dim * (heads + 2 * kv + heads) * 4 * (sp - 1) // sp
    assert calls == layers * 8
    assert sent == layers * per_layer


def test_bad_sp_sizes_fail_with_clear_messages():
    model = tiny_model()
    assert check_sequence_parallel(model, 2) == []
    assert "does not divide the 4 attention heads" in check_sequence_parallel(model, 3)[0]
    with pytest.raises(LayoutError, match="parallel.sp=3 does not divide the world size 4"):
        ParallelDims.resolve(ParallelConfig(sp=3), 4)
    assert kv_repeat_factor(8, 2, 4) == 2 and kv_repeat_factor(8, 8, 4) == 1
