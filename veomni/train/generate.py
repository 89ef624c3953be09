"""Decoding for a quick look at what the model learned (``train.sample_prompt``, at the end of a run).

Every rank runs the same decode with the same seed, so all ranks pick the same tokens and FSDP's
collectives stay matched. The decode is ``veomni.generation.generate`` (with its KV cache).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from veomni.generation import SamplingParams, generate
from veomni.parallel.sequence import full_sequence_attention
from veomni.tasks.lm import LanguageModelingTask

logger = logging.getLogger(__name__)


def sample_tokens(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, eos_id: int | None = None,
                  temperature: float = 0.0, top_k: int = 0, seed: int = 0) -> list[int]:
    """Continue ``prompt_ids`` (an eos ends it, kept); ``temperature=0`` is greedy, else top-k sampling."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                            stop_token_ids=() if eos_id is None else (eos_id,), seed=seed)
    return generate(model, [prompt_ids], params)[0].tokens


def sample_prompt(cfg: Any, model: nn.Module | None, tokenizer: Any, task: Any) -> tuple[str, str] | None:
    """The end of run's look at the model: (how it was decoded, prompt + continuation of
    ``train.sample_prompt``), for text models whose ranks hold the whole model; None elsewhere."""
    train = cfg.train
    if model is None or tokenizer is None or not isinstance(task, LanguageModelingTask):
        logger.warning("train.sample_prompt skipped: sampling decodes text with the whole model in one process "
                       "(not under parallel.pp, and only for language-modelling tasks with a tokenizer)")
        return None
    prompt = tokenizer.encode(train.sample_prompt)
    with full_sequence_attention(model):  # every rank decodes the whole prompt
        out = sample_tokens(model, prompt, train.sample_tokens, tokenizer.eos_token_id,
                            train.sample_temperature, train.sample_top_k, seed=train.seed)
    how = f"sampled at temperature {train.sample_temperature:g}, top-k {train.sample_top_k}" \
        if train.sample_temperature > 0 else "greedy (the most likely token each time)"
    return f"{how}, {len(out)} tokens", train.sample_prompt + tokenizer.decode(out)
