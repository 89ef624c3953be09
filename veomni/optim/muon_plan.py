"""Which ranks orthogonalise which matrix: Newton-Schulz needs a whole matrix, so under FSDP2
(rows split over ranks) each matrix gets an owner team in its shard group -- one rank, or, for a
matrix too large for any single owner to keep the ranks balanced, a team of ranks that split its
iteration by column blocks (``muon_split.py``: every product of the quintic divides exactly by the
team's size).

Teams are chosen by greedy LPT (longest processing time first: the largest part goes to the least
loaded ranks) with the cost of an m x n matrix ~ m n min(m, n) (every term of the quintic is a
product with the short side squared). While the plan's max/mean exceeds the target
(``optim.muon_split_balance``), the unit whose part is the largest has its team doubled and LPT
runs again, teams of 2 before any of 4 and so on (a team of k exchanges (k^2 - 1) s^2 elements per
iteration, so more small teams move less than fewer large ones); the best plan seen wins (ties:
the earlier, with fewer splits, so less communication). Pure functions of shapes: every rank
computes the same plan, and ``--dry-run`` reports it for a recipe without building anything.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

BALANCE_TARGET = 1.05
"""Max / mean Newton-Schulz FLOPs per rank below which no more iterations are split."""


def ns_flops(rows: int, cols: int, steps: int = 5) -> float:
    """Multiply-add FLOPs of ``steps`` quintic iterations on an rows x cols matrix (short side s,
    long side l: X X^T 2 s^2 l, the polynomial's square 2 s^3, its product with X 2 s^2 l)."""
    short, long_ = min(rows, cols), max(rows, cols)
    return steps * (4.0 * short * short * long_ + 2.0 * short ** 3)


@dataclass(frozen=True)
class OwnerPlan:
    teams: tuple[tuple[int, ...], ...]
    """Ranks (within the shard group, ascending) that orthogonalise each unit, in the units' order;
    one rank owns the unit alone, several split its iteration."""
    loads: tuple[float, ...]
    """Newton-Schulz FLOPs per rank."""

    @property
    def balance(self) -> float:
        """max / mean load (1.0 is perfect); 1.0 when there is no work."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean else 1.0


def plan_owners(costs: Sequence[float], ranks: int, max_team: Sequence[int] | None = None,
                target: float = BALANCE_TARGET) -> OwnerPlan:
    """Teams for units of ``costs`` over ``ranks``; unit i's team has at most ``max_team[i]`` ranks
    (default: one, no splitting); ``target`` 0 never splits."""
    return _plan(tuple(costs), ranks, tuple(max_team or (1,) * len(costs)), target)


@functools.lru_cache(maxsize=64)
def _plan(costs: tuple[float, ...], ranks: int, max_team: tuple[int, ...], target: float) -> OwnerPlan:
    sizes, level = [1] * len(costs), 2
    best = plan = _lpt(costs, sizes, ranks)
    while target and plan.balance > target:
        splittable = [i for i, size in enumerate(sizes) if 2 * size <= min(max_team[i], ranks, level)]
        if not splittable:
            if level >= ranks:
                break
            level *= 2
            continue
        largest = max(splittable, key=lambda i: (costs[i] / sizes[i], -i))
        sizes[largest] *= 2
        plan = _lpt(costs, sizes, ranks)
        if plan.balance < best.balance:
            best = plan
    return best


def _lpt(costs: Sequence[float], sizes: Sequence[int], ranks: int) -> OwnerPlan:
    """Units by decreasing part cost (ties by index), each to the ``sizes[i]`` least loaded ranks
    (ties: lowest), each of which takes ``costs[i] / sizes[i]``."""
    teams: list[tuple[int, ...]] = [()] * len(costs)
    heap = [(0.0, rank) for rank in range(ranks)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i] / sizes[i], i)):
        taken = [heapq.heappop(heap) for _ in range(sizes[index])]
        teams[index] = tuple(sorted(rank for _, rank in taken))
        for load, rank in taken:
            heapq.heappush(heap, (load + costs[index] / sizes[index], rank))
    loads = [0.0] * ranks
    for index, team in enumerate(teams):
        for rank in team:
            loads[rank] += costs[index] / sizes[index]
    return OwnerPlan(tuple(teams), tuple(loads))
