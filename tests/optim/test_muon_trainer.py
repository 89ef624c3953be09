"""Muon through the engine's own step on the tiny Qwen3 LLM: FSDP 2 (``parallelize``: FSDP2 with
its reduce-scattered DTensor gradients) and PP 2 (one Muon + AdamW pair per stage) equal one
process by the parity rule, on the parameters after the steps."""

import pytest

from harness.gloo_ranks import run_distributed
from tests.parallel.test_pipeline_parity import OPTIONS, global_steps, merged, run_pipeline_steps
from tests.parity_utils import assert_parity, full_params, tiny_model
from veomni.config.schema import OptimConfig, ParallelConfig, TrainConfig
from veomni.data.packing import pack_samples
from veomni.optim import build_optimizer
from veomni.parallel.apply import parallelize
from veomni.parallel.mesh import ParallelDims, build_mesh
from veomni.tasks import LanguageModelingTask
from veomni.train.step import clip_and_step, forward_backward

pytestmark = pytest.mark.full  # the engine's whole step on 1 + 2 + 2 ranks: the full tier (tests/conftest.py)

MUON = TrainConfig(optimizer="muon", lr=0.02, weight_decay=0.1)
FALLBACK = OptimConfig(muon_fallback="sgd")
"""SGD for what Muon does not take: AdamW's division by sqrt(v) amplifies the 1e-8 rounding of
near-zero gradients past the parity rule (``tests/parity_utils.py``), which would hide Muon's."""


def _plain(rank, world, parallel: ParallelConfig) -> dict:
    dims = ParallelDims.resolve(parallel, world)
    meshes = build_mesh(dims, "cpu")
    model = tiny_model(**OPTIONS)
    if world > 1:  # the reference keeps plain tensors (parallelize would make 1-rank DTensors)
        model = parallelize(model, parallel, meshes, "cpu")
    optimizer = build_optimizer(model, MUON, optim=FALLBACK)
    task = LanguageModelingTask()
    for samples in global_steps():
        mine = samples[meshes.dp_rank::dims.dp_size]
        forward_backward(model, task, [pack_samples(mine)], meshes.loss.get_group(), dims.loss_size, dims.row_ranks)
        clip_and_step(model, optimizer, None, max_grad_norm=0.0)
    assert any(type(o).__name__ == "Muon" for o in optimizer.optimizers)
    return full_params(model)


def _assert_params(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert_parity(got[name], tensor, name)


def test_fsdp_2_and_pp_2_equal_one_process():
    want = run_distributed(_plain, 1, ParallelConfig())[0]
    for got in run_distributed(_plain, 2, ParallelConfig(dp_shard=2)):
        _assert_params(got, want)
    records = run_distributed(run_pipeline_steps, 2, ParallelConfig(pp=2, dp_shard=1), 2, OPTIONS, 0.5, "llm",
                              None, MUON, FALLBACK)
    _assert_params(merged(records)["params"], want)
