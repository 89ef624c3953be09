"""Packing token samples into padding-free micro-batches.

A micro-batch is one row of concatenated samples with per-sample boundaries (``cu_seqlens``,
restarting ``position_ids``), so attention never crosses samples and no compute goes to padding.
Rows vary in length up to a token budget (dynamic batch size) instead of a fixed batch shape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import accumulate
from typing import TypeVar

import torch

from veomni.tasks.base import IGNORE_INDEX

Tag = TypeVar("Tag")
Item = TypeVar("Item")


def chunk_document(ids: Sequence[int], max_len: int, start: int = 0) -> Iterator[tuple[int, Sequence[int]]]:
    """Yield ``(offset, ids[offset:offset + max_len])`` for consecutive chunks from ``start``.

    The offset lets a resumed reader continue inside a partly consumed document.
    """
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    for offset in range(start, len(ids), max_len):
        yield offset, ids[offset : offset + max_len]


def greedy_pack(
    samples: Iterable[tuple[Item, Tag]], budget: int, cost: Callable[[Item], int] = len
) -> Iterator[tuple[list[Item], Tag | None]]:
    """Fill micro-batches in stream order up to ``budget`` (a sample costs ``cost(sample)``:
    its tokens by default; text tokens plus encoder patches for samples with media).

    ``samples`` yields ``(sample, tag)``; a sample that does not fit starts the next
    micro-batch (order is kept, nothing is split or padded). Yields ``(batch, next_tag)`` where
    ``next_tag`` is the tag of the first sample *not* in ``batch`` (``None`` once the stream is
    exhausted): the position a resumed reader must restart from.
    """
    batch: list[Item] = []
    used = 0
    for sample, tag in samples:
        size = cost(sample)
        if not 0 < size <= budget:
            raise ValueError(f"sample of cost {size} cannot be packed into a budget of {budget}")
        if batch and used + size > budget:
            yield batch, tag
            batch, used = [], 0
        batch.append(sample)
        used += size
    if batch:
        yield batch, None


def pack_samples(samples: Sequence[Sequence[int]]) -> dict:
    """Build the micro-batch dict of one packed row from a list of token lists.

    Keys: ``input_ids``, ``labels`` (next token within the same sample, else -100),
    ``position_ids`` (restart at 0 per sample), ``cu_seqlens`` (int32, ``[0, ..., T]``),
    ``max_seqlen`` and ``num_samples``.
    """
    if not samples or any(len(s) == 0 for s in samples):
        raise ValueError("pack_samples needs at least one sample and no empty ones")
    input_ids: list[int] = []
    labels: list[int] = []
    position_ids: list[int] = []
    for sample in samples:
        input_ids.extend(sample)
        labels.extend(sample[1:])
        labels.append(IGNORE_INDEX)
        position_ids.extend(range(len(sample)))
    lengths = [len(s) for s in samples]
    return {
        "input_ids": torch.tensor(input_ids, dtype=torch.long),
        "labels": torch.tensor(labels, dtype=torch.long),
        "position_ids": torch.tensor(position_ids, dtype=torch.long),
        "cu_seqlens": torch.tensor([0, *accumulate(lengths)], dtype=torch.int32),
        "max_seqlen": max(lengths),
        "num_samples": len(samples),
    }


def pack_with_targets(samples: Sequence[Sequence[int]], targets: Sequence[Sequence[bool]]) -> dict:
    """``pack_samples``, with a label kept only where the token it predicts is a loss target
    (``targets[s][i]``: token ``i`` of sample ``s`` is one): a chat's labels on its answers only.
    A sample's last label stays -100, so no sample predicts the next one's first token."""
    if [len(t) for t in targets] != [len(s) for s in samples]:
        raise ValueError("pack_with_targets needs one target flag per token of every sample")
    batch = pack_samples(samples)
    is_target = torch.tensor([t for sample in targets for t in sample], dtype=torch.bool)
    next_is_target = torch.zeros_like(is_target)
    next_is_target[:-1] = is_target[1:]
    batch["labels"] = torch.where(next_is_target, batch["labels"], IGNORE_INDEX)
    return batch
