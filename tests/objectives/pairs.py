"""Packed preference rows for the objective tests: pairs of (prompt + chosen, prompt + rejected)
token lists with loss targets on the replies only, as the chat_preference kind packs them."""

from __future__ import annotations

import torch

from veomni.data.packing import pack_with_targets

VOCAB = 97


def pair_tokens(n_pairs: int, seed: int = 1) -> list[tuple[list[int], list[int], list[int]]]:
    """``n_pairs`` (prompt, chosen, rejected) token lists of varied lengths."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(low: int, high: int) -> list[int]:
        return torch.randint(0, VOCAB, (int(torch.randint(low, high, (1,), generator=gen)),), generator=gen).tolist()

    return [(tokens(3, 9), tokens(2, 8), tokens(2, 8)) for _ in range(n_pairs)]


def packed_pairs(pairs: list[tuple[list[int], list[int], list[int]]]) -> dict:
    """One packed row: chosen then rejected of each pair, targets on the reply tokens."""
    samples, targets = [], []
    for prompt, chosen, rejected in pairs:
        for reply in (chosen, rejected):
            samples.append(prompt + reply)
            targets.append([False] * len(prompt) + [True] * len(reply))
    return pack_with_targets(samples, targets)
