"""Decoding for a quick look at what the model learned.

Every rank runs the same decode with the same seeded generator, so all ranks pick the same
tokens and FSDP's collectives stay matched. There is no KV cache: the prompt is short and
this runs once, at the end of training.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def sample_tokens(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, device: torch.device,
                  eos_id: int | None = None, temperature: float = 0.0, top_k: int = 0, seed: int = 0) -> list[int]:
    """Continue ``prompt_ids``; ``temperature=0`` is greedy, else top-k sampling."""
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        n = len(ids)
        logits = model(
            torch.tensor(ids, device=device),
            torch.arange(n, device=device),
            torch.tensor([0, n], dtype=torch.int32, device=device),
            n,
        )[-1].float().cpu()
        if temperature > 0:
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
        else:
            next_id = int(logits.argmax())
        ids.append(next_id)
        if next_id == eos_id:
            break
    model.train(was_training)
    return ids[len(prompt_ids):]
