"""Prompts as the model takes them: one packed row of prompts, each followed by what was generated
for it so far, with each token's position.

A prompt is a list of token ids (text models) or a ``ChatSample`` (a chat with media: images and
videos in the prompt, for the omni and Qwen-VL families; packed by ``pack_chat_samples`` with the
model's ``MediaLayout``, which gives its tokens their (t, h, w) M-RoPE positions). A generated
token's position continues from the prompt's largest position plus one, on every axis: for text
that is the next index; for M-RoPE it is transformers' ``rope_deltas`` rule for Qwen2-VL and
Qwen2.5-VL. (For a video whose time positions outrun its height and width, that is *not* what
recomputing the (t, h, w) positions of the whole finished text would give, so a forward pass that
must see what generation saw, an RL update's, takes ``sequence_positions``.)
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

from veomni.contract.media import MediaLayout
from veomni.data.chat.media_dataset import ChatSample, pack_chat_samples
from veomni.data.packing import pack_samples
from veomni.errors import BadData

Prompt = Sequence[int] | ChatSample


def prompt_ids(prompt: Prompt) -> list[int]:
    return list(prompt.chat.ids) if isinstance(prompt, ChatSample) else list(prompt)


def prompt_positions(prompt: Prompt, layout: MediaLayout | None = None) -> torch.Tensor:
    """The positions of the prompt's tokens: [n], or [n, 3] where the layout computes M-RoPE's."""
    ids = prompt_ids(prompt)
    if isinstance(prompt, ChatSample) and layout is not None and layout.position_ids is not None:
        return layout.position_ids(torch.tensor(ids, dtype=torch.long), prompt.media)
    return torch.arange(len(ids))


def continued_positions(positions: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``positions`` of a prompt ([n] or [n, 3]) followed by those of ``new_tokens`` generated
    tokens: the largest prompt position + 1, + 2, ... on every axis."""
    start = int(positions.max()) + 1
    more = torch.arange(start, start + new_tokens, dtype=positions.dtype, device=positions.device)
    return torch.cat([positions, more if positions.ndim == 1 else more[:, None].expand(-1, positions.shape[1])])


def sequence_positions(prompt: Prompt, new_tokens: int, layout: MediaLayout | None = None) -> torch.Tensor:
    """The positions generation gave ``prompt`` followed by ``new_tokens`` generated tokens: what a
    forward pass over the finished sequence must use to see what generation saw."""
    return continued_positions(prompt_positions(prompt, layout), new_tokens)


def check_prompts(prompts: Sequence[Prompt]) -> None:
    """``BadData`` naming the first problem: no prompts, an empty one, or chats mixed with id lists."""
    if not prompts:
        raise BadData("generate: no prompts given")
    chats = [isinstance(p, ChatSample) for p in prompts]
    if any(chats) and not all(chats):
        raise BadData("generate: prompts mix ChatSamples (chats with media) and token-id lists; pass one kind")
    empty = [i for i, p in enumerate(prompts) if not prompt_ids(p)]
    if empty:
        raise BadData(f"generate: prompt {empty[0]} has no tokens; every prompt needs at least one")


def pack_prompts(prompts: Sequence[Prompt], generated: Sequence[Sequence[int]],
                 layout: MediaLayout | None = None) -> dict:
    """One packed row of ``prompts[i] + generated[i]``: ``input_ids``, ``position_ids`` (the
    prompt's, continued over its generated tokens), ``cu_seqlens``, ``max_seqlen``, and for chats
    ``media`` (the prompts' items, encoder inputs and placeholder positions)."""
    if not isinstance(prompts[0], ChatSample):
        return pack_samples([[*p, *g] for p, g in zip(prompts, generated)])
    batch = pack_chat_samples(list(prompts), layout)  # the prompts' media, at their places in a row of prompts
    shift = torch.tensor([0, *(len(g) for g in generated)]).cumsum(0)  # each prompt's start moves by this
    for entry in batch["media"].values():
        sample = torch.searchsorted(batch["cu_seqlens"][1:].long(), entry["positions"], right=True)
        entry["positions"] = entry["positions"] + shift[sample]
    rows = [[*p.chat.ids, *g] for p, g in zip(prompts, generated)]
    return {"input_ids": torch.tensor([t for row in rows for t in row], dtype=torch.long),
            "position_ids": torch.cat([sequence_positions(p, len(g), layout) for p, g in zip(prompts, generated)]),
            "cu_seqlens": torch.tensor([0, *accumulate(len(row) for row in rows)], dtype=torch.int32),
            "max_seqlen": max(len(row) for row in rows), "media": batch["media"]}
