"""Which positions of a packed row each rank holds under sequence and context parallelism.

Ulysses alone (``sp``) gives each rank ``1/sp`` of the row, consecutive.

Context parallelism (``cp``) balances attention work, not just tokens. The row is padded to a
multiple of ``2 * cp * sp``; then *every sample* (and the padding tail, last) is cut into
``2 * cp`` pieces and cp rank ``r`` takes pieces ``r`` and ``2cp - 1 - r`` of each (per-sample
zig-zag). Under a causal mask piece ``i`` of a sample costs in proportion to ``i + 1/2``, so every
rank gets the same work from every sample, however the row is packed. (Zig-zag over the whole row
balances only a row holding one sample: measured on a 128k-token row of 22 packed documents at
cp = 8, the busiest rank computed 1.67x the mean; see docs/context_parallel.md.) Piece sizes differ
by at most one token; the spare tokens go round-robin over the piece indices, so every rank holds
exactly ``padded / cp`` tokens. A rank holds its pieces in row order, so padding comes last; its
``sp`` ranks split its chunk consecutively.

What is split is the task's batch contract: its ``sequence_fields``, padded with its
``pad_values`` (labels: no target) and gathered at the rank's positions; every other field
(``cu_seqlens``, ``max_seqlen``) stays global, so attention sees the true sample boundaries
and RoPE the global positions, except fields that point into the row (an omni batch's
placeholder positions), which the contract's ``localize`` rewrites from ``RowSplit.placement``
(which rank holds each position, and where). ``valid_tokens`` counts the slice's real (leading) rows, so MoE
layers leave the padding unrouted. A row that was already padded (a pipeline micro-batch, whose
``valid_tokens`` says where its real rows end) keeps that: its padding is at the end of the row,
so it is a suffix of every rank's ascending positions too.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from veomni.tasks.base import BatchContract, RowPlacement


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

    def positions(self, bounds: list[int], total: int) -> torch.Tensor:
        """Global positions (in the padded row) this rank holds, in the order it holds them;
        ``bounds`` are the row's ``cu_seqlens``."""
        padded = self.padded(total)
        if self.cp > 1:
            chunk = torch.cat([torch.arange(p.start, p.end) for p in cp_pieces(bounds, padded, self.cp)[self.cp_rank]])
        else:
            chunk = torch.arange(padded)
        local = chunk.shape[0] // self.sp
        return chunk[self.sp_rank * local:(self.sp_rank + 1) * local]

    def placement(self, bounds: list[int], total: int) -> RowPlacement:
        """Which rank of the row holds each position of the padded row, and where in its slice."""
        padded = self.padded(total)
        holder = torch.empty(padded, dtype=torch.long)
        local = torch.empty(padded, dtype=torch.long)
        for cp_rank in range(self.cp):
            for sp_rank in range(self.sp):
                held = dataclasses.replace(self, sp_rank=sp_rank, cp_rank=cp_rank).positions(bounds, total)
                holder[held] = cp_rank * self.sp + sp_rank
                local[held] = torch.arange(held.shape[0])
        return RowPlacement(holder, local, self.cp_rank * self.sp + self.sp_rank)


class Piece(NamedTuple):
    """Global positions ``[start, end)`` of piece ``index`` (of ``2 cp``) of sample ``sample``
    (-1: the padding tail), at offset ``local`` in its rank's chunk."""

    sample: int
    index: int
    start: int
    end: int
    local: int


def cp_pieces(bounds: list[int], padded: int, cp: int) -> list[list[Piece]]:
    """Each cp rank's pieces, in the order the rank holds them (per-sample zig-zag, see above)."""
    parts, spare = 2 * cp, 0
    spans = [(i, a, b) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))] + [(-1, bounds[-1], padded)]
    ranks: list[list[Piece]] = [[] for _ in range(cp)]
    filled = [0] * cp
    for sample, start, end in spans:
        base, extra = divmod(end - start, parts)
        sizes = [base + ((index - spare) % parts < extra) for index in range(parts)]
        spare = (spare + extra) % parts
        offsets = [start, *itertools.accumulate(sizes, initial=start)][1:]
        for index in range(parts):
            owner = index if index < cp else parts - 1 - index
            if sizes[index]:
                ranks[owner].append(Piece(sample, index, offsets[index], offsets[index] + sizes[index], filled[owner]))
                filled[owner] += sizes[index]
    return ranks


def shard_batch(batch: dict[str, Any], split: RowSplit, contract: BatchContract) -> dict[str, Any]:
    """This rank's part of each of the contract's sequence fields of a packed row; fields that
    point into the row are rewritten by the contract's ``localize``; every other field stays
    global. ``valid_tokens`` in ``batch`` (rows from there on are padding) is honoured."""
    total = contract.row_length(batch)
    real = batch.get("valid_tokens")
    real = total if real is None else int(real)
    padded = split.padded(total)
    if split.cp > 1 and "cu_seqlens" not in batch:
        raise ValueError("context parallelism splits rows by their samples, but the batch has no cu_seqlens")
    bounds = batch["cu_seqlens"].tolist() if split.cp > 1 else [0, total]
    positions = split.positions(bounds, total)
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
    if contract.localize is not None:
        out.update(contract.localize(batch, split.placement(bounds, total)))
    return out
