"""Greedy decoding for a quick look at what the model learned.

Every rank runs the same decode so FSDP's collectives stay matched; there is no KV cache
(the prompt is short and this runs once at the end of training).
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def greedy_decode(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, device: torch.device,
                  eos_id: int | None = None) -> list[int]:
    was_training = model.training
    model.eval()
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        n = len(ids)
        logits = model(
            torch.tensor(ids, device=device),
            torch.arange(n, device=device),
            torch.tensor([0, n], dtype=torch.int32, device=device),
            n,
        )
        next_id = int(logits[-1].argmax())
        ids.append(next_id)
        if next_id == eos_id:
            break
    model.train(was_training)
    return ids[len(prompt_ids):]
