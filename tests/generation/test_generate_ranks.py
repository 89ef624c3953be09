"""Generation under FSDP 2 and under expert parallelism 2, on real gloo ranks: each rank continues
its own prompts, which finish after different numbers of steps, and ``lockstep`` (an all-reduce)
keeps the finished rank stepping until the other is done, so every forward's collectives match;
with a small prefill budget the ranks also need different numbers of prefill forwards (2 and 1).
Each rank's completions equal one process generating its prompts with the whole model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.gloo_ranks import run_distributed
from tests.parity_utils import assert_parity, tiny_model
from veomni.config.schema import ParallelConfig
from veomni.generation import SamplingParams, generate
from veomni.parallel.apply import parallelize
from veomni.parallel.mesh import ParallelDims, build_mesh

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
PROMPTS = {0: [[3, 17, 29, 41, 5], [60, 2]], 1: [[9, 33, 71, 8, 90, 14, 55]]}
PARAMS = {0: SamplingParams(max_new_tokens=3), 1: SamplingParams(max_new_tokens=9, temperature=1.0, seed=4)}


def _every_rank_done(done: bool) -> bool:
    flag = torch.tensor([int(done)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _generate(rank: int, world: int, parallel: ParallelConfig, options: dict, prefill_tokens: int) -> list:
    model = tiny_model(init_std=0.2, **options)
    model = parallelize(model, parallel, build_mesh(ParallelDims.resolve(parallel, world), "cpu"), "cpu")
    return generate(model, PROMPTS[rank], PARAMS[rank], lockstep=_every_rank_done, prefill_tokens=prefill_tokens)


@pytest.mark.parametrize("prefill_tokens", [8192, 5], ids=["one-prefill", "prefills-differ"])
@pytest.mark.parametrize("parallel,options", [(ParallelConfig(dp_shard=2), {}), (ParallelConfig(ep=2), MOE)],
                         ids=["fsdp2", "ep2"])
def test_ranks_generate_what_one_process_does(parallel, options, prefill_tokens) -> None:
    model = tiny_model(init_std=0.2, **options)
    for rank, got in enumerate(run_distributed(_generate, 2, parallel, options, prefill_tokens)):
        want = generate(model, PROMPTS[rank], PARAMS[rank])
        assert [c.tokens for c in got] == [c.tokens for c in want]
        for a, b in zip(got, want):
            assert_parity(torch.tensor(a.logprobs), torch.tensor(b.logprobs), f"rank {rank} log-probs")
