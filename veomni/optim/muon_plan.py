"""Which rank orthogonalises which matrix: Newton-Schulz needs a whole matrix, so under FSDP2
(rows split over ranks) each matrix gets one owner rank in its shard group. Owners are chosen by
greedy LPT (longest processing time first: the largest Newton-Schulz cost goes to the least
loaded rank), with the cost of an m x n matrix ~ m n min(m, n) (every term of the quintic is a
product with the short side squared). Pure functions of shapes: every rank computes the same
plan, and ``--dry-run`` reports it for a recipe without building anything."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


def ns_flops(rows: int, cols: int, steps: int = 5) -> float:
    """Multiply-add FLOPs of ``steps`` quintic iterations on an rows x cols matrix (short side s,
    long side l: X X^T 2 s^2 l, the polynomial's square 2 s^3, its product with X 2 s^2 l)."""
    short, long_ = min(rows, cols), max(rows, cols)
    return steps * (4.0 * short * short * long_ + 2.0 * short ** 3)


@dataclass(frozen=True)
class OwnerPlan:
    owners: tuple[int, ...]
    """Owner rank (within the shard group) of each unit, in the units' order."""
    loads: tuple[float, ...]
    """Newton-Schulz FLOPs per rank."""

    @property
    def balance(self) -> float:
        """max / mean load (1.0 is perfect); 1.0 when there is no work."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean else 1.0


def plan_owners(costs: Sequence[float], ranks: int) -> OwnerPlan:
    """LPT: units by decreasing cost (ties by index), each to the least loaded rank (ties: lowest)."""
    owners = [0] * len(costs)
    heap = [(0.0, rank) for rank in range(ranks)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(heap)
        owners[index] = rank
        heapq.heappush(heap, (load + costs[index], rank))
    loads = [0.0] * ranks
    for index, rank in enumerate(owners):
        loads[rank] += costs[index]
    return OwnerPlan(tuple(owners), tuple(loads))
