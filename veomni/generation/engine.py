"""Batched generation with a key/value cache: prompts in; per prompt ``params.n`` continuations,
each with its generated tokens, their log-probabilities and why it stopped.

The prompts are prefilled in packed rows of at most ``prefill_tokens`` tokens (a prompt longer
than that gets a row of its own); each row's keys and values go into the cache slot of the
prompt's first continuation and are copied to its other ``n - 1`` (so a prompt, and its images
and videos, are encoded once however many continuations share it), and its last logits give each
continuation's first token. Then each decode step feeds one packed row of the unfinished
sequences' last tokens, at their next positions, and attends over the cache (``kv_cache.py``).
``use_cache=False`` runs the same loop by re-packing every prompt (``n`` times) with all its tokens
so far at every step (the reference the cache must equal, and the speed baseline).

Under a data-parallel layout (FSDP, expert parallelism) every rank must run the same number of
forwards, as each forward holds collectives; ``lockstep(done) -> all ranks done`` (an all-reduce
the caller supplies, before every forward, prefill or decode) keeps a rank that has finished
stepping on one scratch token until every rank has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from veomni.contract.media import MediaLayout

from .kv_cache import CacheStep, KVCache, kv_cache_attention
from .params import Completion, SamplingParams
from .prompts import Prompt, check_prompts, pack_prompts, prompt_ids, prompt_positions
from .sampling import choose_tokens

DEFAULT_PREFILL_TOKENS = 8192
"""Prompt tokens per prefill forward: bounds its logits ([tokens, vocab]) and activations."""


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _forward(model: nn.Module, batch: dict, device: torch.device) -> torch.Tensor:
    media = {"media": batch["media"]} if batch.get("media") else {}
    return model(batch["input_ids"].to(device), batch["position_ids"].to(device), batch["cu_seqlens"].to(device),
                 int(batch["max_seqlen"]), **_to(media, device))


def _to(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def prefill_chunks(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Prompt indices in order, cut into runs of at most ``budget`` tokens (a longer prompt alone)."""
    chunks: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if chunks[-1] and used + n > budget:
            chunks.append([])
            used = 0
        chunks[-1].append(i)
        used += n
    return chunks


class _Run:
    """The state of one ``generate`` call: what each prompt produced so far."""

    def __init__(self, sequences: int, params: SamplingParams, device: torch.device) -> None:
        self.params = params
        self.completions = [Completion() for _ in range(sequences)]
        self.active: list[int] = []
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)

    def take(self, indices: Sequence[int], logits: torch.Tensor) -> None:
        """Choose the next token of each sequence in ``indices`` from its logits row."""
        tokens, logprobs = choose_tokens(logits, self.params, self.generator)
        stop = set(self.params.stop_token_ids)
        for i, token, logprob in zip(indices, tokens.tolist(), logprobs.tolist()):
            done = self.completions[i]
            done.tokens.append(token)
            done.logprobs.append(logprob)
            if token in stop:
                done.finish_reason = "stop"
            elif len(done.tokens) < self.params.max_new_tokens:
                continue
            self.active.remove(i)


@torch.no_grad()
def generate(model: nn.Module, prompts: Sequence[Prompt], params: SamplingParams, *,
             layout: MediaLayout | None = None, use_cache: bool = True,
             prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
             lockstep: Callable[[bool], bool] | None = None) -> list[Completion]:
    """Continue every prompt (token-id lists, or ``ChatSample`` chats with media and the model's
    ``layout``) under ``params``: ``params.n`` ``Completion``s per prompt, prompt by prompt (those of
    prompt ``i`` at ``i * n ... i * n + n - 1``). The model runs in ``eval()`` mode and gets its mode
    back."""
    check_prompts(prompts)
    device = _device(model)
    run = _Run(len(prompts) * params.n, params, device)
    was_training = model.training
    model.eval()
    try:
        if use_cache:
            _generate_cached(model, prompts, run, layout, prefill_tokens, lockstep, device)
        else:
            copies = [prompt for prompt in prompts for _ in range(params.n)]
            _generate_uncached(model, copies, run, layout, lockstep, device)
    finally:
        model.train(was_training)
    return run.completions


def _generate_cached(model: nn.Module, prompts: Sequence[Prompt], run: _Run, layout: MediaLayout | None,
                     prefill_tokens: int, lockstep: Callable[[bool], bool] | None, device: torch.device) -> None:
    n = run.params.n  # sequence s continues prompt s // n
    lengths = [len(prompt_ids(p)) for p in prompts]
    scratch = len(run.completions)  # a slot for the token a finished rank feeds while others go on (lockstep)
    cache = KVCache(scratch + 1, max(lengths) + run.params.max_new_tokens)
    next_position = [int(prompt_positions(p, layout).max()) + 1 for p in prompts]
    chunks = prefill_chunks(lengths, prefill_tokens)
    with kv_cache_attention(model, cache):
        while True:
            active = list(run.active)
            if _all_done(bool(chunks or active), lockstep):
                return
            if chunks:
                chunk = chunks.pop(0)
                batch = pack_prompts([prompts[i] for i in chunk], [[] for _ in chunk], layout)
                firsts = [i * n for i in chunk]
                cache.step = CacheStep.build(firsts, [0] * len(chunk), [lengths[i] for i in chunk], device)
                logits = _forward(model, batch, device)[batch["cu_seqlens"][1:].long() - 1]
                cache.share(firsts, n, max(lengths[i] for i in chunk))
                sequences = [s for first in firsts for s in range(first, first + n)]
                run.active.extend(sequences)
                run.take(sequences, logits.repeat_interleave(n, dim=0))
                continue
            if not active:  # this rank is done, another is not: one scratch token keeps the collectives matched
                cache.step = CacheStep.build([scratch], [0], [1], device)
                _forward(model, _decode_batch([0], [0]), device)
                continue
            cached = [lengths[i // n] + len(run.completions[i].tokens) - 1 for i in active]
            cache.step = CacheStep.build(active, cached, [1] * len(active), device)
            positions = [next_position[i // n] + len(run.completions[i].tokens) - 1 for i in active]
            logits = _forward(model, _decode_batch([run.completions[i].tokens[-1] for i in active], positions),
                              device)
            run.take(active, logits)


def _all_done(working: bool, lockstep: Callable[[bool], bool] | None) -> bool:
    """Whether to stop: this rank has no work left, and with ``lockstep`` every other rank neither."""
    return lockstep(not working) if lockstep is not None else not working


def _decode_batch(tokens: list[int], positions: list[int]) -> dict:
    """One row of one token per sequence."""
    return {"input_ids": torch.tensor(tokens), "position_ids": torch.tensor(positions),
            "cu_seqlens": torch.arange(len(tokens) + 1, dtype=torch.int32), "max_seqlen": 1}


def _generate_uncached(model: nn.Module, prompts: Sequence[Prompt], run: _Run, layout: MediaLayout | None,
                       lockstep: Callable[[bool], bool] | None, device: torch.device) -> None:
    run.active = list(range(len(prompts)))
    while True:
        active = list(run.active)
        if _all_done(bool(active), lockstep):
            return
        if not active:
            _forward(model, _decode_batch([0], [0]), device)
            continue
        batch = pack_prompts([prompts[i] for i in active], [run.completions[i].tokens for i in active], layout)
        logits = _forward(model, batch, device)
        run.take(active, logits[batch["cu_seqlens"][1:].long() - 1])
