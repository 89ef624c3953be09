"""Decoding for a quick look at what the model learned.

Every rank runs the same decode with the same seeded generator, so all ranks pick the same
tokens and FSDP's collectives stay matched. There is no KV cache: the prompt is short and
this runs once, at the end of training (``sample_prompt``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from veomni.parallel.sequence import full_sequence_attention
from veomni.tasks.lm import LanguageModelingTask

logger = logging.getLogger(__name__)


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


def sample_prompt(cfg: Any, model: nn.Module | None, tokenizer: Any, task: Any,
                  device: torch.device) -> tuple[str, str] | None:
    """The end of run's look at the model: (how it was decoded, prompt + continuation of
    ``train.sample_prompt``), for text models whose ranks hold the whole model; None elsewhere."""
    train = cfg.train
    if model is None or tokenizer is None or not isinstance(task, LanguageModelingTask):
        logger.warning("train.sample_prompt skipped: sampling decodes text with the whole model in one process "
                       "(not under parallel.pp, and only for language-modelling tasks with a tokenizer)")
        return None
    prompt = tokenizer.encode(train.sample_prompt)
    with full_sequence_attention(model):  # every rank decodes the whole prompt
        out = sample_tokens(model, prompt, train.sample_tokens, device, tokenizer.eos_token_id,
                            train.sample_temperature, train.sample_top_k, seed=train.seed)
    how = f"sampled at temperature {train.sample_temperature:g}, top-k {train.sample_top_k}" \
        if train.sample_temperature > 0 else "greedy (the most likely token each time)"
    return f"{how}, {len(out)} tokens", train.sample_prompt + tokenizer.decode(out)
