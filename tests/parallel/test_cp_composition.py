"""Context parallelism composed with the other recipes, against one process (fp32, SGD).

HSDP x cp, full activation checkpointing under cp, MoE with expert parallelism under cp (the
expert loads and the auxiliary loss must match too), pipeline parallelism with cp and with sp
(each pipeline row is cut to the rank's positions after the step's loader rows are joined), and
the trainer: a pp x cp run's losses and eval loss, and generation at the end of a cp run with
the plain attention cores restored. Ring means ``cp_mesh: [1, cp]``. The rows' lengths do not
divide by ``2 x cp``, and their samples straddle the zig-zag chunk boundaries.
"""

import json

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.parallel.test_pipeline_parity import MOE as PIPELINE_MOE
from tests.parallel.test_pipeline_parity import OPTIONS as PIPELINE_OPTIONS
from tests.parallel.test_pipeline_parity import _moe_reference, _reference, check, check_moe, run_pipeline_steps
from tests.parity_utils import (
    assert_records_close,
    assert_scalar_parity,
    assert_series_parity,
    run_steps,
    sample_lengths,
    tiny_model,
)
from tests.trainer_utils import tiny_run_config
from veomni.config.schema import ParallelConfig
from veomni.data.packing import pack_samples
from veomni.parallel.context import ContextParallelAttention
from veomni.parallel.pipeline.rows import pad_row
from veomni.parallel.row_split import RowSplit, shard_batch
from veomni.tasks import LM_CONTRACT

STEPS = [sample_lengths(7, seed=30), sample_lengths(6, seed=31), sample_lengths(5, seed=32)]  # 3: sign-based bias
# updates of +-rate cannot cancel to zero over an odd number of steps
RING2 = dict(cp=2, cp_mesh=[1, 2])

MOE = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, router_scoring="sigmoid",
           norm_topk_prob=True, routed_scaling_factor=2.0, shared_expert_intermediate_size=24,
           router_aux_loss_coef=0.02, router_z_loss_coef=0.01, router_bias_update_rate=0.05)
"""Sigmoid routing with selection bias, a shared expert, balance and z losses: every statistic moves."""


def _run(rank, world, parallel, options):
    """The cp x sp ranks of a row read the same samples; data-parallel ranks (outermost in the
    mesh after pp) read every ``dp``-th sample."""
    row_ranks = parallel.cp * parallel.sp
    dp_world, dp_rank = world // row_ranks, rank // row_ranks
    return run_steps([[samples[dp_rank::dp_world]] for samples in STEPS], parallel, options=options)


@pytest.fixture(scope="module")
def dense_reference():
    return run_distributed(_run, 1, ParallelConfig(), None)[0]


@pytest.fixture(scope="module")
def moe_reference():
    return run_distributed(_run, 1, ParallelConfig(), MOE)[0]


def test_rows_do_not_divide_by_the_zigzag_multiple():
    assert all(pack_samples(s)["input_ids"].numel() % 4 for s in STEPS)
    halves = [pack_samples(s[r::2])["input_ids"].numel() for s in STEPS for r in range(2)]
    assert any(n % 4 for n in halves)


@pytest.mark.parametrize("world, parallel", [
    (4, ParallelConfig(dp_replicate=2, **RING2)),
    (2, ParallelConfig(activation_checkpointing="full", **RING2)),
], ids=["hsdp2xcp2", "cp2-ac-full"])
def test_dense_llm_with_cp_matches_single_process(dense_reference, world, parallel):
    for got in run_distributed(_run, world, parallel, None):
        assert_records_close(dense_reference, got)


@pytest.mark.parametrize("world, parallel", [
    (2, ParallelConfig(ep=2, **RING2)),
    (4, ParallelConfig(ep=4, **RING2)),  # dp_shard=2 x cp=2, experts over all four
], ids=["cp2xep2", "dp2xcp2-ep4"])
def test_moe_with_cp_and_expert_parallel_matches_single_process(moe_reference, world, parallel):
    """cp pads each row to a multiple of 4 and deals it out in zig-zag chunks: the padding must
    stay unrouted on every rank (``valid_tokens``) for the loads and bias updates to match."""
    assert any(b.abs().sum() > 0 for n, b in moe_reference["buffers"].items() if n.endswith("expert_bias"))
    for got in run_distributed(_run, world, parallel, MOE):
        assert_records_close(moe_reference, got)
        for ref_m, got_m in zip(moe_reference["metrics"], got["metrics"]):
            assert got_m["moe/tokens_per_expert"] == ref_m["moe/tokens_per_expert"]
            assert_scalar_parity(got_m["moe/aux_loss"], ref_m["moe/aux_loss"], "moe/aux_loss")


# ----- pipeline parallelism with sequence / context parallelism -----------------------------

def test_a_padded_row_keeps_its_real_length_when_split():
    """A pipeline row is padded to a fixed length before the split; ``valid_tokens`` then counts
    this rank's real positions, not the padding (which is a suffix of each rank's positions)."""
    row = pad_row(pack_samples([[1, 2, 3], [4, 5, 6, 7, 8]]), 16, LM_CONTRACT)  # 8 real of 16
    assert row["valid_tokens"] == 8
    parts = [shard_batch(row, RowSplit(cp_rank=r, cp=2), LM_CONTRACT) for r in range(2)]
    # per-sample zig-zag, 4 pieces each: sample [1, 2, 3] -> 1,1,1,0; [4..8] -> 1,1,1,2 (its spare token
    # continues round-robin at piece 3); padding 8 -> 2,2,2,2. Rank 0 takes pieces 0 and 3, rank 1 pieces 1, 2.
    assert [p["input_ids"].tolist() for p in parts] == [[1, 4, 7, 8, 0, 0, 0, 0], [2, 3, 5, 6, 0, 0, 0, 0]]
    assert [p["valid_tokens"] for p in parts] == [4, 4]
    short = pad_row(pack_samples([[1, 2, 3]]), 16, LM_CONTRACT)  # pieces 1,1,1,0 then padding 3,3,3,4
    assert [shard_batch(short, RowSplit(cp_rank=r, cp=2), LM_CONTRACT)["valid_tokens"] for r in range(2)] == [1, 2]


@pytest.fixture(scope="module")
def pipeline_reference():
    return run_distributed(_reference, 1, PIPELINE_OPTIONS)[0]


@pytest.mark.parametrize("parallel", [
    ParallelConfig(pp=2, pp_schedule="1F1B", **RING2),
    ParallelConfig(pp=2, pp_schedule="1F1B", sp=2),
], ids=["pp2xcp2-1f1b", "pp2xsp2-1f1b"])
def test_pipeline_with_row_split_matches_single_process(pipeline_reference, parallel):
    """4 ranks: 2 pipeline stages, each run by the 2 ranks that split every row."""
    check(pipeline_reference, run_distributed(run_pipeline_steps, 4, parallel, 4))


def test_moe_pipeline_with_cp_matches_single_process():
    """Pipeline rows are padded to a fixed length, then split: each stage's experts route only
    the real positions of this rank's slice, and the loads reduce to the one-process ones."""
    reference = run_distributed(_moe_reference, 1, 1, 2)[0]
    check_moe(reference, run_distributed(run_pipeline_steps, 4, ParallelConfig(pp=2, **RING2), 2, PIPELINE_MOE))


# ----- the trainer ------------------------------------------------------------------------

def _trainer_config(tmp, parallel):
    cfg = tiny_run_config(tmp, max_steps=3, grad_accum=4, optimizer="sgd", lr=0.1)
    cfg.model.options.update(num_layers=4, tie_embeddings=False)
    cfg.parallel = parallel
    cfg.train.sample_prompt = "def value"
    cfg.train.sample_tokens = 6
    cfg.train.sample_temperature = 0.0
    return cfg


def _train(rank, world, tmp, parallel):
    from veomni.train.trainer import Trainer

    trainer = Trainer(_trainer_config(tmp, parallel))
    history = trainer.train()
    cores = [] if trainer.model is None else [m.attn_fn for m in trainer.model.modules() if hasattr(m, "attn_fn")]
    summary = json.loads((tmp / "out" / "summary.json").read_text()) if rank == 0 else None
    return {"loss": [m["loss"] for m in history], "tokens": [m.get("tokens") for m in history],
            "eval_loss": trainer.last_eval["eval_loss"], "baseline": trainer.baseline.loss,
            "cp_cores": sum(isinstance(fn, ContextParallelAttention) for fn in cores), "summary": summary}


@pytest.fixture(scope="module")
def trainer_reference(tmp_path_factory):
    return run_distributed(_train, 1, tmp_path_factory.mktemp("one"), ParallelConfig())[0]


def _assert_same_run(reference, got, same_tokens=True):
    assert_series_parity(got["loss"], reference["loss"], "losses")
    if same_tokens:
        assert got["tokens"] == reference["tokens"]
    assert_scalar_parity(got["eval_loss"], reference["eval_loss"], "eval loss")
    assert got["baseline"] == pytest.approx(reference["baseline"], abs=1e-9)


def test_trainer_pp2_x_cp2_matches_one_process(trainer_reference, tmp_path):
    """Whole loader rows reach the pipeline runner, which cuts the joined rows: the losses,
    token counts, eval loss and the eval baseline (over dp only: every cp rank saw whole rows)
    are the one-process ones."""
    for got in run_distributed(_train, 4, tmp_path, ParallelConfig(pp=2, **RING2)):
        _assert_same_run(trainer_reference, got)


def test_generation_after_a_cp_run_uses_the_plain_cores(trainer_reference, tmp_path):
    """The end-of-run sample decodes the whole prompt on every rank (``full_sequence_attention``
    strips the ring for the decode and puts it back): the greedy text equals one process's."""
    results = run_distributed(_train, 2, tmp_path, ParallelConfig(**RING2))
    for got in results:
        # (``tokens`` without a pipeline counts the slices' lengths, the cp padding included)
        _assert_same_run(trainer_reference, got, same_tokens=False)
        assert got["cp_cores"] == 4  # restored after the sample
    assert trainer_reference["summary"]["sample"].startswith("def value")
    assert results[0]["summary"]["sample"] == trainer_reference["summary"]["sample"]


def _whole_row_under_the_hybrid(rank, world):
    from veomni.parallel.apply import parallelize
    from veomni.parallel.mesh import ParallelDims, build_mesh
    from veomni.parallel.sequence import UlyssesAttention, full_sequence_attention

    parallel = ParallelConfig(sp=2, cp=2, cp_mesh=[1, 2])
    meshes = build_mesh(ParallelDims.resolve(parallel, world), "cpu")
    plain = tiny_model()
    model = parallelize(tiny_model(), parallel, meshes, "cpu")
    batch = pack_samples(sample_lengths(4, seed=42))  # the whole row (103 tokens), on every rank
    args = (batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], batch["max_seqlen"])
    with torch.no_grad(), full_sequence_attention(model):
        got = model(*args)
    cores = [m.attn_fn for m in model.modules() if hasattr(m, "attn_fn")]
    restored = all(isinstance(fn, UlyssesAttention) and isinstance(fn.inner, ContextParallelAttention)
                   for fn in cores)
    with torch.no_grad():
        expected = plain(*args)
    return float((got - expected).abs().max()), restored, len(cores), batch["input_ids"].numel()


def test_full_sequence_attention_strips_the_hybrid():
    """Under Ulysses 2 x ring 2 every rank runs a whole (odd-length) row through the plain cores
    inside ``full_sequence_attention``, as one process does, and gets both wrappers back after."""
    for diff, restored, cores, tokens in run_distributed(_whole_row_under_the_hybrid, 4):
        assert tokens % 2 == 1 and cores == 2
        assert restored
        assert diff < 1e-5
