"""The top-k and top-p cuts against transformers' logits processors (an independent
implementation), and the log-probability a step returns for its chosen token."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from veomni.generation import SamplingParams
from veomni.generation.sampling import choose_tokens, restrict


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.6), (7, 0.3), (0, 0.999)])
def test_cuts_keep_what_transformers_keeps(top_k, top_p) -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    want = logits.clone()
    if top_k:
        want = TopKLogitsWarper(top_k)(None, want)
    if top_p < 1:
        want = TopPLogitsWarper(top_p)(None, want)
    got = restrict(logits, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(got)])


def test_a_sampled_token_comes_from_the_cut_and_carries_its_temperature_1_logprob() -> None:
    logits = torch.randn(64, 30, generator=torch.Generator().manual_seed(1)) * 2
    params = SamplingParams(temperature=0.5, top_k=3, seed=0)
    tokens, logprobs = choose_tokens(logits, params, torch.Generator().manual_seed(0))
    assert (tokens[:, None] == torch.topk(logits, 3).indices).any(-1).all()
    assert torch.equal(logprobs, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1))
    greedy, _ = choose_tokens(logits, SamplingParams(), None)
    assert torch.equal(greedy, logits.argmax(-1))
