"""The next token of every sequence of a step from its logits: greedy, or drawn at a temperature
after the top-k and top-p cuts, with its log-probability under the model (temperature 1)."""

from __future__ import annotations

import torch

from .params import SamplingParams


def restrict(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` [n, V] with every token outside the top-k, then outside the top-p nucleus, at
    -inf. The nucleus keeps the most likely tokens up to and including the one whose cumulative
    probability first reaches ``top_p`` (so at least one token), as transformers' ``TopPLogitsWarper``."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        before = torch.softmax(ordered, dim=-1).cumsum(-1) - torch.softmax(ordered, dim=-1)
        drop = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, before >= top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def choose_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [n], their log-probabilities [n] fp32 at temperature 1) from ``logits`` [n, V]."""
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(-1)
    else:
        probs = torch.softmax(restrict(logits / params.temperature, params.top_k, params.top_p), dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs
