"""The GRPO update under FSDP 2, SP 2 and EP 2 (MoE) equals one process: losses, metrics,
gradients and parameters over two updates of one rollout batch (the second with ratios away from 1,
so the clip and the kept ``old`` log-probabilities act), with the k3 KL to a frozen reference and
the sequence-mean aggregation, whose per-completion sums must be completed over a split row.

The one-process run takes the step's micro-batches in order; a data-parallel rank takes its share;
the ranks of a row group take the same rows and keep their slices."""

from __future__ import annotations

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.parallel.test_ep_parity import MOE
from tests.parity_utils import (
    assert_grads_parity,
    assert_parity,
    assert_scalar_parity,
    full_grads,
    full_params,
    tiny_model,
)
from veomni.config.schema import ParallelConfig, RunConfig
from veomni.objectives import FrozenModels, ObjectiveRequest, build_objective
from veomni.objectives.grpo import ROLLOUT_KEY
from veomni.objectives.rollout import pack_rollouts
from veomni.parallel.apply import parallelize
from veomni.parallel.mesh import ParallelDims, build_mesh
from veomni.parallel.row_split import shard_batch
from veomni.tasks.lm import LanguageModelingTask
from veomni.train.step import clip_and_step, forward_backward

METRICS = ("clip_fraction", "entropy", "ratio", "kl")


def rollout_rows(micro_batches: int = 4, samples: int = 3, seed: int = 5) -> list[dict]:
    """Fixed rollout rows: random prompts and completions of varied lengths, random advantages."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(low: int, high: int) -> list[int]:
        return torch.randint(0, 97, (int(torch.randint(low, high, (1,), generator=gen)),), generator=gen).tolist()

    rows = []
    for mb in range(micro_batches):
        prompts, completions = [tokens(3, 8) for _ in range(samples)], [tokens(2, 9) for _ in range(samples)]
        advantages = torch.randn(samples, generator=gen).tolist()
        rows.append({**pack_rollouts(prompts, completions, advantages), ROLLOUT_KEY: (0, mb)})
    return rows


def _run(rank: int, world: int, parallel: ParallelConfig, moe: bool = False) -> dict:
    dims = ParallelDims.resolve(parallel, world)
    meshes = build_mesh(dims, "cpu")
    options = {**MOE["softmax"], "router_aux_loss_coef": 0.0, "router_z_loss_coef": 0.0} if moe else {}
    policy = parallelize(tiny_model(0, **options), parallel, meshes, "cpu")
    reference = parallelize(tiny_model(1, **options), parallel, meshes, "cpu").requires_grad_(False)
    cfg = RunConfig()
    cfg.train.objective = "grpo"
    cfg.rl.aggregation, cfg.rl.kl_coef, cfg.rl.clip_low, cfg.rl.clip_high = "seq-mean-token-mean", 0.1, 0.1, 0.1
    found = build_objective(ObjectiveRequest(cfg, LanguageModelingTask()))
    row_group = meshes.row.get_group() if dims.row_ranks > 1 else None
    found.attach(FrozenModels(policy, lambda: reference, False, row_group))
    task = found.task
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=3.0)
    rows = rollout_rows()
    mine = rows if dims.dp_size == 1 else rows[meshes.dp_rank::dims.dp_size]
    record: dict = {"loss": [], "metrics": [], "grads": []}
    for _ in range(2):  # two updates of one rollout batch
        batches = [shard_batch(task.prepare(dict(row)), meshes.row_split, task.contract) for row in mine]
        metrics = forward_backward(policy, task, batches, meshes.loss.get_group(), dims.loss_size, dims.row_ranks)
        record["loss"].append(metrics["loss"])
        record["metrics"].append({name: metrics[name] for name in METRICS})
        record["grads"].append(full_grads(policy))
        clip_and_step(policy, optimizer, None, max_grad_norm=0.0)
    record["params"] = full_params(policy)
    return record


LAYOUTS = {  # (world, parallel, moe)
    "fsdp2": (2, ParallelConfig(dp_shard=2), False),
    "sp2": (2, ParallelConfig(dp_shard=1, sp=2), False),
    "moe-ep2": (2, ParallelConfig(dp_shard=2, ep=2), True),
}


FAST = {"sp2"}
"""The rest run in the full tier (FSDP 2 also runs in tests/objectives/test_grpo_run.py's whole job)."""


@pytest.mark.parametrize("layout", [name if name in FAST else pytest.param(name, marks=pytest.mark.full)
                                    for name in sorted(LAYOUTS)])
def test_grpo_update_under_a_layout_equals_one_process(layout: str) -> None:
    world, parallel, moe = LAYOUTS[layout]
    reference = run_distributed(_run, 1, ParallelConfig(), moe)[0]
    assert reference["metrics"][1]["clip_fraction"] > 0, "the second update's ratios leave the clip range"
    for got in run_distributed(_run, world, parallel, moe):
        for update in range(2):
            assert_scalar_parity(got["loss"][update], reference["loss"][update], f"update {update} loss")
            for name in METRICS:
                assert_scalar_parity(got["metrics"][update][name], reference["metrics"][update][name],
                                     f"update {update} {name}")
            assert_grads_parity(got["grads"][update], reference["grads"][update], f"update {update}")
        for name, value in reference["params"].items():
            assert_parity(got["params"][name], value, f"param {name}")
