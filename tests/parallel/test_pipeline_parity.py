"""Pipeline parallelism against one process: every schedule, pp=2 (and pp=4), pp x FSDP.

Each rank of a pipeline holds only its stages' parameters, so the ranks' gradients and updated
parameters are merged by name and compared with the one-process run on the same samples
(fp32, SGD): losses, every gradient and every updated parameter must match.
"""

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.parity_utils import (
    TINY_LLM,
    assert_records_close,
    assert_scalar_parity,
    full_grads,
    full_params,
    run_steps,
    sample_lengths,
)
from veomni.config.schema import OptimConfig, ParallelConfig, TrainConfig
from veomni.contract import build_model
from veomni.data.packing import pack_samples
from veomni.ops.attention import SeqInfo
from veomni.optim import build_optimizer
from veomni.parallel.apply import PIPELINE_HOOKS, parallelize
from veomni.parallel.mesh import ParallelDims, build_mesh
from veomni.parallel.pipeline.stages import build_pipeline
from veomni.tasks import LanguageModelingTask
from veomni.train.runners.pipeline_step import pipeline_forward_backward
from veomni.train.step import clip_and_step

STEPS = 2
LAYERS = 4
ROW_TOKENS = 8 * 40  # the step's 8 samples hold at most 40 tokens each
OPTIONS = {"num_layers": LAYERS, "tie_embeddings": False}


def global_steps(n_samples: int = 8) -> list[list[list[int]]]:
    return [sample_lengths(n_samples, seed=20 + s) for s in range(STEPS)]


def split(samples: list, pieces: int) -> list[list]:
    size = -(-len(samples) // pieces)
    return [samples[i * size:(i + 1) * size] for i in range(pieces)]


def build(options: dict, arch: str = "llm", prepare=None):
    torch.manual_seed(0)  # as tests.parity_utils.tiny_model: the constructor draws from the RNG too
    model = build_model(arch, {**TINY_LLM, **options})[1]
    if prepare is not None:
        prepare(model)
    return model


def run_pipeline_steps(rank: int, world: int, parallel: ParallelConfig, microbatches: int,
                       options: dict = OPTIONS, lr: float = 0.5, arch: str = "llm", prepare=None,
                       train: TrainConfig | None = None, optim: OptimConfig | None = None) -> dict:
    """The pipelined twin of ``parity_utils.run_steps``: this rank's data share (by dp rank) cut
    into ``microbatches`` micro-batches, SGD, records of this rank's stages only. ``prepare``
    edits every build of the model (before the cut; weights it sets must not depend on
    ``init_weights``, which runs after it, as in the trainer's ``adapted_model`` builder). ``train``,
    ``optim``: another optimizer than SGD (``tests/optim/test_muon_trainer.py``)."""
    dims = ParallelDims.resolve(parallel, world)
    meshes = build_mesh(dims, "cpu")
    task = LanguageModelingTask()
    pipe = build_pipeline(lambda: build(options, arch, prepare), lambda m: m.init_weights(),
                          lambda m: parallelize(m, parallel, meshes, "cpu"), parallel, microbatches, meshes.pp,
                          torch.device("cpu"), task, hooks=PIPELINE_HOOKS)
    optimizer = build_optimizer(pipe.parts, train or TrainConfig(optimizer="sgd", lr=lr, weight_decay=0.0), optim=optim)
    with torch.device("meta"):
        flops_model = build(options, arch)
    record = {"loss": [], "grads": [], "metrics": [], "grad_norm": []}
    for samples in global_steps():
        mine = samples[meshes.dp_rank::dims.dp_size]
        batches = [pack_samples(piece) for piece in split(mine, microbatches)]
        metrics = pipeline_forward_backward(pipe, task, batches, meshes.loss.get_group(), dims.loss_size, dims.pp,
                                            ROW_TOKENS // microbatches, flops_model, split=meshes.row_split)
        record["loss"].append(metrics["loss"])
        record["metrics"].append({k: v for k, v in metrics.items() if k.startswith(("loss_", "moe/"))})
        grads = {}
        for part in pipe.parts:
            grads.update(full_grads(part))
        record["grads"].append(grads)
        stepped = clip_and_step(pipe.parts, optimizer, None, 0.0, meshes.pp.get_group(), uncounted=pipe.uncounted)
        record["grad_norm"].append(stepped["grad_norm"])
    record["params"] = {k: v for part in pipe.parts for k, v in full_params(part).items()}
    record["buffers"] = {name.replace("_checkpoint_wrapped_module.", ""): b.detach().clone()
                         for part in pipe.parts for name, b in part.named_buffers()}
    return record


def merged(records: list[dict]) -> dict:
    """One record from a pipeline's ranks: gradients and parameters united by name."""
    out = {"loss": records[0]["loss"], "metrics": records[0]["metrics"], "params": {}, "buffers": {},
           "grads": [{} for _ in records[0]["grads"]]}
    for rec in records:
        assert rec["loss"] == pytest.approx(records[0]["loss"], abs=1e-9), "ranks disagree on the logged loss"
        assert rec["grad_norm"] == pytest.approx(records[0]["grad_norm"], abs=1e-9)
        assert rec["metrics"] == records[0]["metrics"], "ranks disagree on the logged metrics"
        out["params"].update(rec["params"])
        out["buffers"].update(rec["buffers"])
        for step, grads in enumerate(rec["grads"]):
            out["grads"][step].update(grads)
    return out


def _reference(rank, world, options, arch="llm"):
    rec = run_steps([[samples] for samples in global_steps()], options=options, arch=arch)
    model = build(options, arch)
    return rec, sorted(n for n, _ in model.named_parameters())


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_reference, 1, OPTIONS)[0]


def check(reference, records):
    ref, names = reference
    got = merged(records)
    assert sorted(got["params"]) == names, "the stages together must hold every parameter exactly once"
    assert_records_close(ref, got)


@pytest.mark.parametrize("schedule, microbatches", [
    ("GPipe", 2), ("1F1B", 4), ("Interleaved1F1B", 4), ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2),
    ("DualPipeV", 4),
])
def test_pp2_matches_single_process(reference, schedule, microbatches):
    parallel = ParallelConfig(pp=2, pp_schedule=schedule)
    check(reference, run_distributed(run_pipeline_steps, 2, parallel, microbatches))


@pytest.mark.parametrize("schedule, checkpointing", [("ZBVZeroBubble", "full"), ("1F1B", "selective")])
def test_pp2_with_activation_checkpointing(reference, schedule, checkpointing):
    """(Selective checkpointing cannot run the zero-bubble split backward: rejected at config time.)"""
    parallel = ParallelConfig(pp=2, pp_schedule=schedule, activation_checkpointing=checkpointing)
    check(reference, run_distributed(run_pipeline_steps, 2, parallel, 2))


def test_pp2_explicit_uneven_split(reference):
    parallel = ParallelConfig(pp=2, pp_schedule="1F1B", pp_layer_split=[1, 3])
    check(reference, run_distributed(run_pipeline_steps, 2, parallel, 2))


@pytest.mark.parametrize("schedule, dp_replicate", [("1F1B", 1), ("Interleaved1F1B", 1), ("ZBVZeroBubble", 1),
                                                    ("1F1B", 2)], ids=["1f1b", "interleaved", "zbv", "1f1b-hsdp"])
def test_pp2_x_fsdp2_matches_single_process(reference, schedule, dp_replicate):
    """4 ranks: 2 pipeline ranks, each an FSDP (or HSDP 2x1) group of 2 reading different halves
    of the data; ZBV also checks that deferred weight gradients reach FSDP's reduce-scatter."""
    parallel = ParallelConfig(pp=2, pp_schedule=schedule, dp_replicate=dp_replicate)
    check(reference, run_distributed(run_pipeline_steps, 4, parallel, 2))


DEEP = dict(OPTIONS, num_layers=8)


@pytest.fixture(scope="module")
def deep_reference():
    return run_distributed(_reference, 1, DEEP)[0]


@pytest.mark.parametrize("schedule, microbatches", [
    ("GPipe", 4), ("1F1B", 4), ("Interleaved1F1B", 4), ("InterleavedZeroBubble", 4), ("ZBVZeroBubble", 4),
    ("DualPipeV", 8),
])
def test_pp4_matches_single_process(deep_reference, schedule, microbatches):
    """8 blocks over 4 pipeline ranks (8 stages for the two-stage-per-rank schedules)."""
    parallel = ParallelConfig(pp=4, pp_schedule=schedule)
    check(deep_reference, run_distributed(run_pipeline_steps, 4, parallel, microbatches, DEEP))

MOE = dict(OPTIONS, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, router_scoring="sigmoid",
           norm_topk_prob=True, routed_scaling_factor=2.0, shared_expert_intermediate_size=24,
           router_aux_loss_coef=0.02, router_z_loss_coef=0.01, router_bias_update_rate=0.05)
"""Sigmoid router with a shared expert, load-balance and z losses and aux-loss-free bias updates."""


def _moe_reference(rank, world, dp_size, microbatches, options=MOE, arch="llm"):
    """One process whose micro-batch i is the union of every data-parallel rank's micro-batch i
    in the pipelined run: the auxiliary losses are per (global) micro-batch."""
    steps = []
    for samples in global_steps():
        per_rank = [split(samples[r::dp_size], microbatches) for r in range(dp_size)]
        steps.append([sum((pieces[i] for pieces in per_rank), []) for i in range(microbatches)])
    return run_steps(steps, options=options, arch=arch)


def check_moe(reference, records):
    assert all(m["moe/bias_update_abs_mean"] > 0 for m in reference["metrics"])  # the biases do move
    got = merged(records)
    assert_records_close(reference, got)
    for ref_m, got_m in zip(reference["metrics"], got["metrics"]):
        assert got_m["moe/tokens_per_expert"] == ref_m["moe/tokens_per_expert"]
        assert_scalar_parity(got_m["moe/aux_loss"], ref_m["moe/aux_loss"], "moe/aux_loss")


@pytest.mark.parametrize("world, parallel", [
    (2, ParallelConfig(pp=2, pp_schedule="1F1B")),
    (2, ParallelConfig(pp=2, pp_schedule="Interleaved1F1B")),
    (2, ParallelConfig(pp=2, pp_schedule="ZBVZeroBubble")),
    (4, ParallelConfig(pp=2, pp_schedule="1F1B", ep=2)),
], ids=["1f1b", "interleaved", "zbv", "1f1b-x-ep2"])
def test_moe_pipeline_matches_single_process(world, parallel):
    """Every stage's auxiliary losses join backward, padding of the fixed-size rows is not
    routed, each stage's router biases move from its own layers' global load, and the metrics
    gather all layers in order; pp=2 x ep=2 runs 2 pipeline ranks of 2 expert-parallel ranks."""
    reference = run_distributed(_moe_reference, 1, world // parallel.pp, 2)[0]
    check_moe(reference, run_distributed(run_pipeline_steps, world, parallel, 2, MOE))


VWN = dict(OPTIONS, vwn_m=2, vwn_n=6, factorized_embedding=True)
"""Virtual Width Network, r = 3: stages pass the wide hyper-connection state (T, n, D/m) on."""


@pytest.mark.parametrize("schedule, microbatches", [("1F1B", 2), ("ZBVZeroBubble", 2)])
def test_vwn_pp2_carries_the_wide_state(schedule, microbatches):
    reference = run_distributed(_reference, 1, VWN, "vwn")[0]
    parallel = ParallelConfig(pp=2, pp_schedule=schedule)
    check(reference, run_distributed(run_pipeline_steps, 2, parallel, microbatches, VWN, 0.5, "vwn"))


def test_vwn_moe_pp2_matches_single_process():
    """A VWN over an MoE backbone pipelines like the decoder: the wide state travels, every
    stage's MoE losses join backward."""
    options = {**VWN, **{k: v for k, v in MOE.items() if k not in OPTIONS}}
    reference = run_distributed(_moe_reference, 1, 1, 2, options, "vwn")[0]
    check_moe(reference, run_distributed(run_pipeline_steps, 2, ParallelConfig(pp=2), 2, options, 0.5, "vwn"))


def test_vwn_with_mtp_is_rejected():
    from veomni.parallel.pipeline.layout import PipelineConfigError
    from veomni.parallel.pipeline.stages import check_pipeline_model

    with pytest.raises(PipelineConfigError, match="outside the pipelined container"):
        check_pipeline_model(build({**VWN, "mtp": True}, "vwn"), ParallelConfig(pp=2), 2, PIPELINE_HOOKS)


def _pool_before_the_head(model) -> None:
    """A planted gap: the forward pools the blocks' output outside any stage piece."""

    def forward_embeddings(x, position_ids, cu_seqlens, max_seqlen, valid_tokens=None):
        seq = SeqInfo(cu_seqlens, int(max_seqlen))
        cos, sin = model.rotary(position_ids, x.dtype)
        for layer in model.layers:
            x = layer(x, cos, sin, seq, valid_tokens)
        return model.lm_head(model.norm(x.mean(0)))

    model.forward_embeddings = forward_embeddings


def test_work_between_stage_pieces_fails_the_first_step_with_the_reason():
    with pytest.raises(AssertionError) as failed:
        run_distributed(run_pipeline_steps, 2, ParallelConfig(pp=2), 2, OPTIONS, 0.5, "llm", _pool_before_the_head,
                        timeout_s=60)
    assert "work in forward between the stage pieces (pooling before the head, say)" in str(failed.value)
    assert "docs/adding_a_model.md" in str(failed.value)
