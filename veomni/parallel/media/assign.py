"""Which ranks encode which media item: pure rules that every rank of a routing group evaluates
on the same gathered prices, so they agree on the answer without another message.

- ``assign_items``: whole items, longest first onto the least-loaded rank (greedy
  longest-processing-time), ties to the item's announcer so fewer items move.
- ``assign_work``: the same with long-short sequence parallelism: items flagged long run over a
  block of ``size`` consecutive ranks, every member holding ``1/size`` of the work; they are placed
  first, largest first, onto the block whose busiest member is least loaded, and the short items
  then fill around them (or stay with their announcer without balancing).
- ``block_chunks``: how a block's long items, packed in canonical order, split into the members'
  contiguous feature chunks (``encoder_sp.split_rows`` on the pack), per item.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Recipients = tuple[int, ...]
"""The ranks that encode one item: one rank (whole), or a block (sequence parallel)."""


def assign_items(costs: Sequence[Sequence[float]], loads: Sequence[float] | None = None) -> list[list[int]]:
    """``costs[r][i]``: the encoder cost of item ``i`` owned by rank ``r`` -> ``runner[r][i]``: the
    rank that encodes it. ``loads``: work the ranks already have (default none).

    Greedy longest-processing-time: items by decreasing cost, each onto the least-loaded rank;
    among equally loaded ranks the owner if it is one, else the lowest rank. Equal costs are taken
    by index within the owner, then owner, so equal items of different owners interleave and
    stay home when the ranks are already even. Greedy is not optimal: when its busiest rank would
    be no less loaded than leaving every item with its owner, nothing moves. Pure and
    deterministic.
    """
    start = list(loads) if loads is not None else [0.0] * len(costs)
    loads = list(start)
    runner = [[-1] * len(owned) for owned in costs]
    order = sorted((-cost, index, owner) for owner, owned in enumerate(costs) for index, cost in enumerate(owned))
    for negative_cost, index, owner in order:
        least = min(loads)
        target = owner if loads[owner] == least else loads.index(least)
        runner[owner][index] = target
        loads[target] -= negative_cost
    home = [load + sum(owned) for load, owned in zip(start, costs)]
    if costs and max(loads) >= max(home):
        return [[owner] * len(owned) for owner, owned in enumerate(costs)]
    return runner


def assign_work(costs: Sequence[Sequence[float]], long: Sequence[Sequence[bool]], size: int,
                balance: bool, loads: Sequence[float] | None = None) -> list[list[Recipients]]:
    """``recipients[r][i]``: the ranks encoding item ``i`` announced by rank ``r`` (see the module
    doc). ``size`` divides the number of ranks; block ``b`` is ranks ``b*size .. b*size+size-1``.
    ``loads``: other work the ranks already have in the step (default none)."""
    ranks = len(costs)
    if ranks % size:
        raise ValueError(f"blocks of {size} ranks do not tile the {ranks} ranks of the routing group")
    loads = list(loads) if loads is not None else [0.0] * ranks
    recipients: list[list[Recipients]] = [[()] * len(owned) for owned in costs]
    blocks = [tuple(range(b * size, (b + 1) * size)) for b in range(ranks // size)]
    order = sorted((-cost, index, owner) for owner, owned in enumerate(costs)
                   for index, cost in enumerate(owned) if long[owner][index])
    for negative_cost, index, owner in order:
        block = min(blocks, key=lambda members: (max(loads[m] for m in members), owner not in members, members))
        for member in block:
            loads[member] -= negative_cost / size
        recipients[owner][index] = block
    short = [[cost for cost, flag in zip(owned, flags) if not flag] for owned, flags in zip(costs, long)]
    runner = assign_items(short, loads) if balance else [[owner] * len(s) for owner, s in enumerate(short)]
    for owner, flags in enumerate(long):
        whole = iter(runner[owner])
        for index, flag in enumerate(flags):
            if not flag:
                recipients[owner][index] = (next(whole),)
    return recipients


def block_chunks(features: Sequence[int], size: int) -> list[list[int]]:
    """A block's long items with ``features[j]`` feature rows each, packed in that order and split
    into ``size`` contiguous chunks of ``ceil(total / size)`` rows (the last ones shorter, as
    ``encoder_sp.split_rows`` cuts the pack) -> ``rows[j][m]``: item ``j``'s rows in member ``m``'s
    chunk."""
    total = sum(features)
    chunk = math.ceil(total / size) if total else 0
    rows, start = [], 0
    for n in features:
        rows.append([max(0, min(start + n, (m + 1) * chunk) - max(start, m * chunk)) for m in range(size)])
        start += n
    return rows
