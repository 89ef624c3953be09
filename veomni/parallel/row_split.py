"""Which positions of a packed row each rank holds under sequence and context parallelism.

Ulysses alone (``sp``) gives each rank ``1/sp`` of the row, consecutive. Context parallelism
(``cp``) first pads the row to a multiple of ``2 * cp * sp`` and cuts it into ``2 * cp`` equal
pieces; cp rank ``r`` holds pieces ``r`` and ``2cp - 1 - r`` (zig-zag: under a causal mask each
rank then has the same attention work), and its ``sp`` ranks split that chunk consecutively.
Padding lies at the end of the row, so it lands at the end of each rank's slice.

What is split is the task's batch contract: its ``sequence_fields``, padded with its
``pad_values`` (labels: no target) and gathered at the rank's positions; every other field
(``cu_seqlens``, ``max_seqlen``) stays global, so attention sees the true sample boundaries
and RoPE the global positions. ``valid_tokens`` counts the slice's real (leading) rows, so MoE
layers leave the padding unrouted. A row that was already padded (a pipeline micro-batch, whose
``valid_tokens`` says where its real rows end) keeps that: its padding is at the end of the row,
so it is a suffix of every rank's ascending positions too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from veomni.tasks.base import BatchContract


@dataclass(frozen=True)
class RowSplit:
    """This rank's coordinates among the ranks that split one row."""

    sp_rank: int = 0
    sp: int = 1
    cp_rank: int = 0
    cp: int = 1

    @property
    def ranks(self) -> int:
        return self.sp * self.cp

    @property
    def multiple(self) -> int:
        """Rows are padded to a multiple of this before the split."""
        return (2 * self.cp if self.cp > 1 else 1) * self.sp

    def padded(self, total: int) -> int:
        return math.ceil(total / self.multiple) * self.multiple

    def positions(self, total: int) -> torch.Tensor:
        """Global positions (in the padded row) this rank holds, in the order it holds them."""
        padded = self.padded(total)
        if self.cp > 1:
            half = padded // (2 * self.cp)
            first, second = self.cp_rank, 2 * self.cp - 1 - self.cp_rank
            chunk = torch.cat([torch.arange(first * half, (first + 1) * half),
                               torch.arange(second * half, (second + 1) * half)])
        else:
            chunk = torch.arange(padded)
        local = chunk.shape[0] // self.sp
        return chunk[self.sp_rank * local:(self.sp_rank + 1) * local]


def shard_batch(batch: dict[str, Any], split: RowSplit, contract: BatchContract) -> dict[str, Any]:
    """This rank's part of each of the contract's sequence fields of a packed row; every other
    field stays global. ``valid_tokens`` in ``batch`` (rows from there on are padding) is honoured."""
    total = contract.row_length(batch)
    real = batch.get("valid_tokens")
    real = total if real is None else int(real)
    padded = split.padded(total)
    positions = split.positions(total)
    out = dict(batch)
    for key in contract.sequence_fields:
        value = batch[key]
        if value.shape[0] != total:
            raise ValueError(f"batch field {key!r} has {value.shape[0]} rows, the row has {total}: every "
                             "sequence field of the task's contract must run along the row")
        if padded > total:
            value = torch.cat([value, value.new_full((padded - total, *value.shape[1:]),
                                                     contract.pad_value(key))])
        out[key] = value[positions.to(value.device)]
    out["valid_tokens"] = int((positions < real).sum())
    return out
