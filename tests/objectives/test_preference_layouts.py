"""DPO under the parallel layouts equals one process: losses, pair metrics, gradients and
parameters after the SGD steps (fp32, the parity rule).

A reply's log-probability is a sum over its tokens and the loss is non-linear in it, so wherever a
row is split (Ulysses SP, ring CP: a pair's halves land on different ranks) the per-sample sums
must be completed before the loss, and its gradient must flow back to every rank's tokens. Data
parallelism (FSDP, HSDP) splits the step's pairs across ranks; expert parallelism routes the
policy's and the reference's tokens through all-to-alls; activation checkpointing recomputes the
policy's forward; LoRA makes the reference the base with adapters off. The one-process run takes
the step's micro-batches in order; a data-parallel rank takes its share; the ranks of a row group
take the same rows and keep their slices.
"""

from __future__ import annotations

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.objectives.pairs import packed_pairs, pair_tokens
from tests.parallel.test_ep_parity import MOE
from tests.parallel.test_lora_parity import adapt
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
from veomni.parallel.apply import parallelize
from veomni.parallel.mesh import ParallelDims, build_mesh
from veomni.parallel.row_split import shard_batch
from veomni.tasks.lm import LanguageModelingTask
from veomni.train.step import clip_and_step, forward_backward

STEPS = [[pair_tokens(2, seed=10 * step + mb) for mb in range(4)] for step in range(2)]
"""Two steps of four micro-batches of two pairs (a data-parallel rank of 2 takes two, of 4 one)."""
BETA = 0.5
PAIR_METRICS = ("rewards_chosen", "rewards_rejected", "rewards_margin", "logps_chosen", "logps_rejected")


def _run(rank: int, world: int, parallel: ParallelConfig, lora: bool, moe: bool = False,
         model_options: dict | None = None, eval_steps: list | None = None) -> dict:
    """``eval_steps``: micro-batches of pairs to score after the steps (one process only)."""
    dims = ParallelDims.resolve(parallel, world)
    meshes = build_mesh(dims, "cpu")
    # Without auxiliary losses: those are summed per global micro-batch (tests/parallel/test_ep_parity.py),
    # a different split here; the preference sums under expert parallelism are what this checks.
    options = {**MOE["softmax"], "router_aux_loss_coef": 0.0, "router_z_loss_coef": 0.0} if moe else {}
    options.update(model_options or {})
    policy = adapt(tiny_model(0, **options)) if lora else tiny_model(0, **options)
    policy = parallelize(policy, parallel, meshes, "cpu")
    reference = parallelize(tiny_model(1, **options), parallel, meshes, "cpu").requires_grad_(False)
    cfg = RunConfig()
    cfg.train.objective, cfg.preference.beta = "dpo", BETA
    found = build_objective(ObjectiveRequest(cfg, LanguageModelingTask()))
    row_group = meshes.row.get_group() if dims.row_ranks > 1 else None
    found.attach(FrozenModels(policy, lambda: reference, lora, row_group))
    task = found.task
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)
    record: dict = {"loss": [], "metrics": [], "grads": []}
    for micro_batches in STEPS:
        mine = micro_batches if dims.dp_size == 1 else micro_batches[meshes.dp_rank::dims.dp_size]
        batches = [shard_batch(task.prepare(packed_pairs(pairs)), meshes.row_split, task.contract)
                   for pairs in mine]
        metrics = forward_backward(policy, task, batches, meshes.loss.get_group(), dims.loss_size, dims.row_ranks)
        record["loss"].append(metrics["loss"])
        record["metrics"].append({name: metrics[name] for name in PAIR_METRICS})
        record["grads"].append(full_grads(policy))
        clip_and_step(policy, optimizer, None, max_grad_norm=0.0)
    record["params"] = full_params(policy)
    with torch.no_grad():
        scored = [task(policy, task.prepare(packed_pairs(pairs))) for pairs in eval_steps or []]
    record["eval"] = [(float(out.loss_sum), {name: float(v) for name, (v, _) in out.metrics.items()})
                      for out in scored]
    return record


def _check(reference: dict, got: dict) -> None:
    for step in range(len(STEPS)):
        assert_scalar_parity(got["loss"][step], reference["loss"][step], f"step {step} loss")
        want = reference["metrics"][step]
        # A reward is beta (log pi - log ref) of two sums near -40 that nearly cancel: their rounding,
        # at the sums' magnitude, bounds its error (the rule's scale floor, as for cancelled gradients).
        scale = BETA * max(abs(want["logps_chosen"]), abs(want["logps_rejected"]))
        for name in PAIR_METRICS:
            assert_parity(torch.tensor(got["metrics"][step][name]), torch.tensor(want[name]), f"step {step} {name}",
                          scale=scale)
        assert_grads_parity(got["grads"][step], reference["grads"][step], f"step {step}")
    for name, value in reference["params"].items():
        assert_parity(got["params"][name], value, f"param {name}")


LAYOUTS = {  # (world, parallel, lora, moe)
    "fsdp2": (2, ParallelConfig(dp_shard=2), False, False),
    "sp2": (2, ParallelConfig(dp_shard=1, sp=2), False, False),
    "cp2": (2, ParallelConfig(dp_shard=1, cp=2, cp_mesh=[1, 2]), False, False),
    "hsdp2x2": (4, ParallelConfig(dp_replicate=2, dp_shard=2), False, False),
    "moe-ep2": (2, ParallelConfig(dp_shard=2, ep=2), False, True),
    "ac-fsdp2": (2, ParallelConfig(dp_shard=2, activation_checkpointing="full"), False, False),
    "lora-fsdp2": (2, ParallelConfig(dp_shard=2), True, False),
    "lora-sp2": (2, ParallelConfig(dp_shard=1, sp=2), True, False),
}


@pytest.fixture(scope="module")
def single() -> dict[tuple[bool, bool], dict]:
    cases = {(lora, moe) for _, _, lora, moe in LAYOUTS.values()}
    return {case: run_distributed(_run, 1, ParallelConfig(), *case)[0] for case in sorted(cases)}


FAST = {"fsdp2", "sp2", "lora-fsdp2"}
"""The rest run in the full tier (about 1.5 s each on an idle machine)."""


@pytest.mark.parametrize("layout", [name if name in FAST else pytest.param(name, marks=pytest.mark.full)
                                    for name in sorted(LAYOUTS)])
def test_dpo_layout_equals_one_process(single: dict[tuple[bool, bool], dict], layout: str) -> None:
    world, parallel, lora, moe = LAYOUTS[layout]
    reference = single[lora, moe]
    assert abs(reference["metrics"][0]["rewards_margin"]) > 1e-3, "the reference differs from the policy"
    for got in run_distributed(_run, world, parallel, lora, moe):
        _check(reference, got)
