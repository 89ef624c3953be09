"""Assigning a group's pending samples to (rank, micro-batch) bins of equal estimated cost.

Data-parallel ranks synchronise every micro-batch, so the slowest rank sets the pace; packing by a
token budget alone leaves a rank that draws long sequences (attention costs ~ len^2) as the
straggler. Instead each rank of a group keeps a window of pending samples, the ranks exchange their
windows' metadata (``Candidate``), and every rank runs ``fill_bins`` on the same list to get the
same assignment. Each bin is filled towards a common cost ``target`` (the same constant on every
group, so groups that never talk are balanced as well), within a units cap (memory), and never left
empty. Samples not chosen stay pending; one that has waited ``max_wait`` steps is placed regardless,
so nothing starves.

Pure functions: no torch, no communication, no randomness.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter


@dataclass(frozen=True, slots=True)
class Candidate:
    """One pending sample as every rank of the group sees it."""

    owner: int  # rank within the group whose window holds it
    index: int  # its position in that window
    units: int  # what it counts against the per-bin units cap
    cost: float  # estimated compute (FLOPs)
    age: int  # steps it has already waited in the window (0 = drawn for this step)


def fill_bins(
    candidates: Sequence[Candidate], ranks: int, micro_batches: int, unit_cap: int, target: float, max_wait: int
) -> list[list[tuple[int, int]]]:
    """Bins in order rank 0's micro-batches 0..A-1, then rank 1's, ...; each bin a list of (owner, index).

    Deterministic (same input -> same output on every rank, no RNG, stable tie-breaks); the order
    the candidates are listed in does not matter.

    1. Forced candidates (``age >= max_wait``), most expensive first, each to the least-loaded bin
       with room for its units, whatever the target.
    2. The others, most expensive first, each to the least-loaded bin with room for its units whose
       cost stays within ``target``; one that fits no bin stays pending.
    3. Each bin still empty takes the cheapest remaining candidate.

    Among equally loaded bins a candidate prefers its owner's (no data to move), then the lowest bin
    index; among equal costs the older candidate goes first, then the lower ``(owner, index)``.

    ``index`` only has to tell an owner's candidates apart. Cost: two sorts and a bisection per
    candidate in the usual case; a group of 8 ranks with windows of 200 samples takes ~2 ms.

    Guarantees: a candidate lands in at most one bin; no bin exceeds ``unit_cap``; a bin exceeds
    ``target`` only through forced candidates, or by holding a single candidate; every bin is
    non-empty when there are at least ``ranks * micro_batches`` candidates; every forced candidate
    is placed when some bin has room for it, in particular when there are no more forced candidates
    than bins.
    """
    _check_arguments(candidates, ranks, micro_batches, unit_cap, target, max_wait)
    ordered = _most_expensive_first(candidates)
    forced = [c for c in ordered if c.age >= max_wait]
    waiting = [c for c in ordered if c.age < max_wait]
    bins = _Bins(ranks, micro_batches, unit_cap)
    pending = [c for c in forced if not bins.place(c, math.inf)]
    cheapest = waiting[-1].cost if waiting else 0.0
    for position, candidate in enumerate(waiting):
        lowest_load = bins.lowest_load()
        if lowest_load + cheapest > target:  # not even the cheapest fits any more
            pending.extend(waiting[position:])
            break
        if lowest_load + candidate.cost > target or not bins.place(candidate, target):
            pending.append(candidate)
    empty = [b for b, contents in enumerate(bins.contents) if not contents]
    if empty:  # so far every candidate went to an empty bin (the least loaded): enough are left over
        pending.sort(key=lambda c: (c.cost, -c.age, c.owner, c.index))
        for b, candidate in zip(empty, pending):
            bins.put(b, candidate)
    return bins.contents


def imbalance(costs: Sequence[float]) -> float:
    """``max / mean`` of the costs: 1.0 is perfect balance (also for no costs or all zero)."""
    if not costs:
        return 1.0
    mean = sum(costs) / len(costs)
    return max(costs) / mean if mean > 0 else 1.0


def per_rank_costs(bins_costs: Sequence[float], micro_batches: int) -> list[float]:
    """Sum each rank's ``micro_batches`` consecutive bin costs (bins ordered as ``fill_bins`` returns them)."""
    if micro_batches <= 0 or len(bins_costs) % micro_batches:
        raise ValueError(f"{len(bins_costs)} bin costs do not split into ranks of {micro_batches} micro-batches")
    return [sum(bins_costs[start : start + micro_batches]) for start in range(0, len(bins_costs), micro_batches)]


def _most_expensive_first(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Decreasing cost, then decreasing age, then increasing (owner, index): stable sorts from the
    last key to the first (C-level keys, much faster than one Python key function)."""
    ordered = sorted(candidates, key=attrgetter("owner", "index"))
    ordered.sort(key=attrgetter("age"), reverse=True)
    ordered.sort(key=attrgetter("cost"), reverse=True)
    return ordered


class _Bins:
    """The bins' contents, loads and free units, with the bins kept sorted by ``(load, bin index)``
    so the least-loaded bin that fits is found by bisection rather than by scanning every bin."""

    def __init__(self, ranks: int, micro_batches: int, unit_cap: int) -> None:
        count = ranks * micro_batches
        self.micro_batches = micro_batches
        self.contents: list[list[tuple[int, int]]] = [[] for _ in range(count)]
        self.loads = [0.0] * count
        self.room = [unit_cap] * count
        self.by_load = [(0.0, b) for b in range(count)]
        self.end = count  # greater than every bin index: (load, end) sorts after all bins of that load

    def lowest_load(self) -> float:
        return self.by_load[0][0]

    def place(self, candidate: Candidate, target: float) -> bool:
        """Put ``candidate`` in the least-loaded bin with room whose load stays within ``target``."""
        position = self._least_loaded_fit(candidate, target)
        if position is None:
            return False
        self.put(self.by_load[position][1], candidate, position)
        return True

    def put(self, b: int, candidate: Candidate, position: int | None = None) -> None:
        if position is None:
            position = bisect_left(self.by_load, (self.loads[b], b))
        del self.by_load[position]
        self.loads[b] += candidate.cost
        self.room[b] -= candidate.units
        self.contents[b].append((candidate.owner, candidate.index))
        insort(self.by_load, (self.loads[b], b))

    def _least_loaded_fit(self, candidate: Candidate, target: float) -> int | None:
        """Position in ``by_load`` of the bin to take, walking the bins by increasing load; bins of
        equal load are tried owner's first, then by index."""
        by_load, room, units = self.by_load, self.room, candidate.units
        load, b = by_load[0]
        if (len(by_load) == 1 or by_load[1][0] != load) and room[b] >= units:  # the usual case: no tie
            return 0 if load + candidate.cost <= target else None
        own_first = candidate.owner * self.micro_batches
        own_end = own_first + self.micro_batches
        start = 0
        while start < len(by_load):
            load = by_load[start][0]
            if load + candidate.cost > target:
                return None
            stop = bisect_right(by_load, (load, self.end), start)
            own_start = bisect_left(by_load, (load, own_first), start, stop)
            own_stop = bisect_left(by_load, (load, own_end), own_start, stop)
            for position in chain(range(own_start, own_stop), range(start, stop)):
                if room[by_load[position][1]] >= units:
                    return position
            start = stop
        return None


def _check_arguments(
    candidates: Sequence[Candidate], ranks: int, micro_batches: int, unit_cap: int, target: float, max_wait: int
) -> None:
    if ranks <= 0 or micro_batches <= 0 or unit_cap <= 0 or max_wait < 0:
        raise ValueError(f"need ranks, micro_batches, unit_cap > 0 and max_wait >= 0, got {ranks}, "
                         f"{micro_batches}, {unit_cap}, {max_wait}")
    if not 0 < target < math.inf:
        raise ValueError(f"target must be positive and finite, got {target}")
    if not candidates:
        return
    owners, units, costs, ages = (list(map(attrgetter(name), candidates)) for name in ("owner", "units", "cost", "age"))
    if not (0 <= min(owners) and max(owners) < ranks and 0 < min(units) and max(units) <= unit_cap
            and all(map(math.isfinite, costs)) and min(costs) > 0 and min(ages) >= 0):
        invalid = next(c for c in candidates if not (0 <= c.owner < ranks and 0 < c.units <= unit_cap
                                                     and 0 < c.cost < math.inf and c.age >= 0))
        raise ValueError(f"{invalid} is invalid for {ranks} ranks and a cap of {unit_cap} units (need "
                         f"0 <= owner < ranks, 0 < units <= cap, a positive finite cost, age >= 0)")
    if len(set(map(attrgetter("owner", "index"), candidates))) != len(candidates):
        raise ValueError("two candidates share the same (owner, index)")
