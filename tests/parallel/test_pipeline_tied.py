"""Pipelines over models whose input embedding and output head are one parameter
(veomni/parallel/pipeline/tied.py): the first and last stages each keep a copy, the copies'
gradients are summed after backward, and training equals one process (fp32, SGD: loss, every
gradient, every parameter after the steps, the gradient norm counted once) for the tiny LLM at
pp=2 (GPipe, 1F1B, and ZBV, whose V holds both copies on rank 0), pp=4 and pp=2 x FSDP 2, and
for the tiny VLM at pp=2. Checkpoints move between pp=2 and one process both ways."""

from __future__ import annotations

import shutil

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.parallel import test_media_pp as media
from tests.parallel.test_pipeline_parity import OPTIONS, build, global_steps, merged, run_pipeline_steps
from tests.parity_utils import assert_records_close, assert_scalar_parity, assert_series_parity, run_steps
from tests.train.test_pipeline_trainer import _config
from veomni.config.schema import ParallelConfig
from veomni.parallel.apply import PIPELINE_HOOKS
from veomni.parallel.pipeline.layout import PipelineConfigError
from veomni.parallel.pipeline.stages import check_pipeline_model
from veomni.train.trainer import Trainer

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

TIED = dict(OPTIONS, tie_embeddings=True)
DEEP_TIED = dict(TIED, num_layers=8)


def with_both_names(record: dict, embed: str, head: str) -> dict:
    """A one-process record (which names the tied parameter once) as a pipeline reports it: under
    both names; and per step the gradient norm, the tied gradient counted once."""
    record["norms"] = [sum(float(g.double().pow(2).sum()) for g in grads.values()) ** 0.5
                       for grads in record["grads"]]
    for grads in record["grads"]:
        grads[head] = grads[embed]
    record["params"][head] = record["params"][embed]
    return record


def _reference(rank, world, options):
    record = run_steps([[samples] for samples in global_steps()], options=options)
    return with_both_names(record, "embed_tokens.weight", "lm_head.weight")


def check(reference: dict, records: list[dict]) -> None:
    got = merged(records)
    assert sorted(got["params"]) == sorted(reference["params"]), "each tied name held by its stage"
    assert_records_close(reference, got)
    for rec in records:
        assert rec["grad_norm"] == pytest.approx(reference["norms"], rel=1e-5), "the tied gradient counts once"


@pytest.mark.parametrize("world, parallel, microbatches, options", [
    (2, ParallelConfig(pp=2, pp_schedule="GPipe"), 2, TIED),
    (2, ParallelConfig(pp=2, pp_schedule="1F1B"), 4, TIED),
    (2, ParallelConfig(pp=2, pp_schedule="ZBVZeroBubble"), 2, TIED),
    (4, ParallelConfig(pp=4, pp_schedule="1F1B"), 4, DEEP_TIED),
    (4, ParallelConfig(pp=2, pp_schedule="1F1B"), 2, TIED),
], ids=["pp2-gpipe", "pp2-1f1b", "pp2-zbv-both-copies-on-rank0", "pp4-1f1b", "pp2-x-fsdp2"])
def test_tied_llm_pipeline_matches_one_process(world, parallel, microbatches, options):
    reference = run_distributed(_reference, 1, options)[0]
    check(reference, run_distributed(run_pipeline_steps, world, parallel, microbatches, options))


def test_stage_copies_start_equal_and_stay_equal():
    """(Also covered by the parity above; said directly:) after the steps both copies are equal."""
    records = run_distributed(run_pipeline_steps, 2, ParallelConfig(pp=2, pp_schedule="1F1B"), 2, TIED)
    torch.testing.assert_close(records[0]["params"]["embed_tokens.weight"],
                               records[1]["params"]["lm_head.weight"], rtol=0, atol=0)


def _vlm_reference(rank, world, options, steps):
    return with_both_names(media._reference(rank, world, options, steps), "llm.embed_tokens.weight",
                           "llm.lm_head.weight")


@pytest.mark.parametrize("colocate", [True, False], ids=["colocated", "inline"])
def test_tied_vlm_pp2_matches_one_process(colocate):
    options = media.TINY_OMNI
    assert options["llm"].get("tie_embeddings", True)
    reference = run_distributed(_vlm_reference, 1, options, media.vlm_steps())[0]
    parallel = ParallelConfig(pp=2, pp_schedule="1F1B", encoder_colocate=colocate)
    records = run_distributed(media._pipelined, 2, parallel, options, media.vlm_steps())
    got = media.merged(records)
    assert sorted(got["params"]) == sorted(reference["params"])
    assert_records_close(reference, got)
    for rec in records:  # (rel: fp32 sums over the 8200 x 32 table; counted twice it would be ~1.4x)
        assert rec["grad_norm"] == pytest.approx(reference["norms"], rel=1e-4)


def test_sharing_inside_the_blocks_is_refused():
    """Only copies between the pieces before and after the blocks are kept: a parameter shared
    between a block and the head would sit on two stages that do not sync it."""
    model = build(TIED)
    model.layers[0].mlp.up_proj.weight = model.layers[3].mlp.up_proj.weight
    with pytest.raises(PipelineConfigError, match="layers.0.mlp.up_proj.weight = layers.3"):
        check_pipeline_model(model, ParallelConfig(pp=2), 2, PIPELINE_HOOKS)


def _run(rank, world, tmp, pp, steps, schedule="1F1B"):
    trainer = Trainer(_config(tmp, pp, schedule, tied=True, max_steps=5))
    if steps is None:
        history = trainer.train()
        return [m["loss"] for m in history if "loss" in m], trainer.evaluate()["eval_loss"], trainer.step
    for _ in range(steps):  # checkpoint.interval=3 saves after the third; the run then "dies"
        trainer.run_step()
    return None


@pytest.mark.parametrize("saved_pp, resumed_pp, schedule", [(2, 1, "1F1B"), (1, 2, "1F1B"), (1, 2, "ZBVZeroBubble")],
                         ids=["pp2-to-pp1", "pp1-to-pp2", "pp1-to-pp2-zbv"])
def test_tied_checkpoint_moves_between_pipeline_sizes(tmp_path, saved_pp, resumed_pp, schedule):
    """AdamW, tied: saved after 3 of 5 steps, resumed at the other layout; the last two losses and
    the eval loss equal the uninterrupted one-process run. (One process keys the tied optimizer
    state by the embedding's name only; the pipeline's last stage reads it through that name; under
    ZBV rank 0, holding both copies and two stage optimizers, reads it once for both and its LR
    schedule keeps driving both optimizers after the load.)"""
    full, full_eval, _ = run_distributed(_run, 1, str(tmp_path / "full"), 1, None)[0]
    saved = tmp_path / "saved"
    run_distributed(_run, saved_pp, str(saved), saved_pp, 3, schedule)
    resumed = tmp_path / "resumed"
    shutil.copytree(saved, resumed)
    losses, eval_loss, step = run_distributed(_run, resumed_pp, str(resumed), resumed_pp, None, schedule)[0]
    assert step == 5
    assert_series_parity(losses, full[3:], "resumed losses")
    assert_scalar_parity(eval_loss, full_eval, "eval loss")
