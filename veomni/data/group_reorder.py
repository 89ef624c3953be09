"""Decentralized grouped reordering: every data-parallel rank gets an equal share of estimated compute.

Ranks synchronise at every micro-batch (FSDP's collectives), so a rank that drew long sequences or
many images sets everyone's pace. Ranks are grouped (by default the ranks of one node). Each rank
keeps a window of samples drawn from its own loader; every step:

1. it tops the window up until it holds at least ``2 x grad_accum`` samples and twice the step's
   target cost;
2. the ranks of the group exchange only their windows' metadata (units, estimated cost, age);
3. every rank computes the same assignment (``balance.fill_bins``): the group's ``ranks x
   grad_accum`` micro-batches each get estimated compute close to one *target*, the same constant
   on every group, so groups are balanced against each other without talking;
4. the chosen samples move to the rank that trains them (one all-to-all of only the samples that
   change rank); the others wait in their owner's window, at most ``max_wait`` steps;
5. each rank packs its micro-batches.

No sample is dropped or repeated, none leaves its group, and the loss is normalised by the step's
global count of loss tokens as always. The target is the compute of ``tokens_per_micro_batch``
tokens' dense work: attention and encoder work are paid for with fewer tokens, never more.

The windows are part of the checkpoint (as references to their samples, re-read at a resume), so
a resumed run continues exactly. Exchanges run on a gloo group of their own (CPU tensors), also
when training runs on NCCL.
"""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from veomni.data.balance import Candidate, fill_bins, imbalance
from veomni.data.stream import Ref
from veomni.data.text.packed import Drawn, PackedTextDataset


@dataclass(frozen=True)
class Pending:
    drawn: Drawn
    units: int
    cost: float
    age: int = 0


def balance_group_size(requested: int, dp_size: int, ranks_per_dp_rank: int) -> int:
    """The balancing group's size: ``requested``, or the data-parallel ranks of one node (torchrun's
    ``LOCAL_WORLD_SIZE`` over the ranks that share a data-parallel rank), kept a divisor of dp_size."""
    if requested:
        if dp_size % requested:
            raise ValueError(f"data.balance_group={requested} must divide the data-parallel size {dp_size}")
        return requested
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dp_size * ranks_per_dp_rank))
    return math.gcd(max(1, local // ranks_per_dp_rank), dp_size)


def balance_groups(dp_ranks: list[list[int]], size: int) -> list[list[int]]:
    """Consecutive runs of ``size`` data-parallel ranks of every data-parallel group (given as global
    ranks in data-parallel order): the groups whose ranks reorder samples among themselves."""
    return [ranks[start:start + size] for ranks in dp_ranks for start in range(0, len(ranks), size)]


class GroupReorder:
    """The step's micro-batches of one rank, balanced within its group."""

    def __init__(self, dataset: PackedTextDataset, loader_iter: Iterator[Drawn], grad_accum: int,
                 cost_of: Callable[[Drawn], float], target: float, max_wait: int, group: Any) -> None:
        self.dataset = dataset
        self._iter = loader_iter
        self.grad_accum = grad_accum
        self.cost_of = cost_of
        self.target = target
        self.max_wait = max_wait
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.me = dist.get_rank(group) if group is not None else 0
        self.window: list[Pending] = []
        self.last: dict[str, float] = {}

    def _pending(self, drawn: Drawn, age: int = 0) -> Pending:
        return Pending(drawn, self.dataset.units(drawn), self.cost_of(drawn), age)

    def _top_up(self) -> None:
        wanted = 2 * self.grad_accum * self.target
        while len(self.window) < 2 * self.grad_accum or sum(p.cost for p in self.window) < wanted:
            self.window.append(self._pending(next(self._iter)))

    def next_step(self) -> list[dict[str, Any]]:
        """This rank's ``grad_accum`` packed micro-batches of the next step."""
        return [self.dataset.pack_drawn(drawn) for drawn in self.assign_step()]

    def assign_step(self) -> list[list[Drawn]]:
        """This rank's samples of the next step, one list per micro-batch."""
        self._top_up()
        mine = [(p.units, p.cost, p.age) for p in self.window]
        windows = [mine] * self.size
        if self.group is not None:
            dist.all_gather_object(windows, mine, group=self.group)
        candidates = [Candidate(owner, index, units, cost, age) for owner, window in enumerate(windows)
                      for index, (units, cost, age) in enumerate(window)]
        bins = fill_bins(candidates, self.size, self.grad_accum, self.dataset.cfg.tokens_per_micro_batch,
                         self.target, self.max_wait)
        received = self._exchange(bins)
        micro_batches = [[received[member] for member in bins[self.me * self.grad_accum + a]]
                         for a in range(self.grad_accum)]
        used = {index for members in bins for owner, index in members if owner == self.me}
        self.window = [replace(p, age=p.age + 1) for i, p in enumerate(self.window) if i not in used]
        self._record(bins, windows)
        return micro_batches

    def _exchange(self, bins: list[list[tuple[int, int]]]) -> dict[tuple[int, int], Drawn]:
        """Every sample of this rank's bins, keyed by (owner, index): its own directly, the others'
        through one all-to-all of the samples that change rank."""
        outgoing: list[list[tuple[int, Drawn]]] = [[] for _ in range(self.size)]
        for slot, members in enumerate(bins):
            destination = slot // self.grad_accum
            for owner, index in members:
                if owner == self.me and destination != self.me:
                    outgoing[destination].append((index, self.window[index].drawn))
        received = {(self.me, index): p.drawn for index, p in enumerate(self.window)}
        if self.group is not None:
            for owner, samples in enumerate(_all_to_all_objects(outgoing, self.group)):
                received.update({(owner, index): drawn for index, drawn in samples})
        return received

    def _record(self, bins: list[list[tuple[int, int]]], windows: list[list[tuple[int, float, int]]]) -> None:
        """The step's estimates, for metrics: imbalance of the group's ranks and fill of the target."""
        costs = [sum(windows[owner][index][1] for owner, index in members) for members in bins]
        per_rank = [sum(costs[r * self.grad_accum:(r + 1) * self.grad_accum]) for r in range(self.size)]
        moved = sum(owner != slot // self.grad_accum for slot, members in enumerate(bins) for owner, _ in members)
        self.last = {"balance_imbalance_est": imbalance(per_rank),
                     "balance_fill": sum(costs) / len(costs) / self.target if self.target else 0.0,
                     "balance_moved": float(moved), "balance_waiting": float(len(self.window))}

    def state_dict(self) -> list[list[Any]]:
        """The window as references to its samples (and their ages)."""
        return [[p.drawn.ref.source, p.drawn.ref.file, p.drawn.ref.offset, p.drawn.ref.item_offset, p.age]
                for p in self.window]

    def load_state_dict(self, pending: list[list[Any]]) -> None:
        self.window = [self._pending(self.dataset.drawn_at(Ref(source, int(file), int(offset), int(item))), int(age))
                       for source, file, offset, item, age in pending]


def _all_to_all_objects(outgoing: list[list[Any]], group: Any) -> list[list[Any]]:
    """``outgoing[r]`` goes to rank ``r`` of ``group``; returns what each rank sent here (pickled,
    one all-to-all of sizes, one of bytes)."""
    payloads = [pickle.dumps(items) for items in outgoing]
    send_sizes = torch.tensor([len(p) for p in payloads], dtype=torch.long)
    recv_sizes = torch.empty_like(send_sizes)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    send = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)  # a pickle is never empty
    recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)
    dist.all_to_all_single(recv, send, recv_sizes.tolist(), send_sizes.tolist(), group=group)
    out, start = [], 0
    for size in recv_sizes.tolist():
        out.append(pickle.loads(recv[start:start + size].numpy().tobytes()))
        start += size
    return out
