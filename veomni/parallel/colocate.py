"""Routing encoder work and its features between ranks: one core (``route_media``) serves
data-parallel balancing, omni models under LLM sequence parallelism, and any caller that needs
media features on ranks other than the ones holding the media.

With a dynamic image:text mix one rank's micro-batch may hold most of the step's images and the
others wait for it; under sequence parallelism every rank of a row holds the same media but needs
only the features of its slice's placeholders. ``route_media`` covers both: each rank of a group
*announces* some items and says, per feature row of each, which rank of the group needs it
(its *destination*); then on every rank of the group:

1. the item counts are all-gathered; with ``balance`` the items' encoder prices
   (``MediaKind.flops`` on the item) and row counts too, and every rank computes the same
   assignment (``assign_items``: longest first onto the least-loaded rank, ties to the announcer
   so fewer items move); without, each item runs on its announcer;
2. each announcer tells every destination how many rows of each of its items it will get
   (an all-to-all of counts);
3. items whose runner is not their announcer travel there with their rows' destinations
   (uneven ``all_to_all_single``, skipped by every rank when nothing moves);
4. each rank runs the encoder once on the items it runs; a rank with none runs the dummy input
   and keeps zero rows of its features, so every rank joins the encoder's FSDP collectives and
   their backward;
5. every feature row goes to its destination with a differentiable all-to-all
   (``all_to_all_single_autograd``): the gradients of the rows travel back to the runner's
   encoder.

Items are independent inside an encoder (the ViT attends within a frame, the audio encoder within
a clip), so each item's features, and the gradients they send back into the encoder weights, are
the ones its owner would have computed itself: the loss and gradients equal one process's
(``tests/test_colocate.py``, ``tests/test_media_sp.py``).

``RoutedMediaFn`` is the model-facing ``MediaFn`` over it. Its ``peers`` are the group ranks that
hold one row (the ``cp x sp`` ranks splitting it, in row-rank order; one rank without sequence
parallelism). The row's media entry then says which row rank holds each feature row
(``holders``, set by the VLM contract when the row is sharded); the peers split the row's items
between them by encoder cost (no communication: they all see the same items), and each receives
exactly the rows of its slice.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from veomni.config.schema import ParallelConfig
from veomni.parallel.mesh import ParallelMeshes
from veomni.spec.media import MediaHost, MediaItem, MediaKind, collate_items

logger = logging.getLogger(__name__)


def assign_items(costs: Sequence[Sequence[float]]) -> list[list[int]]:
    """``costs[r][i]``: the encoder cost of item ``i`` owned by rank ``r`` -> ``runner[r][i]``: the
    rank that encodes it.

    Greedy longest-processing-time: items by decreasing cost, each onto the least-loaded rank;
    among equally loaded ranks the owner if it is one, else the lowest rank. Equal costs are taken
    by index within the owner, then owner, so equal items of different owners interleave and
    stay home when the ranks are already even. Pure and deterministic: every rank computes the
    same answer from the same gathered costs.
    """
    loads = [0.0] * len(costs)
    runner = [[-1] * len(owned) for owned in costs]
    order = sorted((-cost, index, owner) for owner, owned in enumerate(costs) for index, cost in enumerate(owned))
    for negative_cost, index, owner in order:
        least = min(loads)
        target = owner if loads[owner] == least else loads.index(least)
        runner[owner][index] = target
        loads[target] -= negative_cost
    return runner



def route_media(group: dist.ProcessGroup, kind: MediaKind, encoder: nn.Module, announced: Sequence[MediaItem],
                destinations: Sequence[torch.Tensor], balance: bool,
                dummy_inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The feature rows destined to this rank, encoded from the items every rank of ``group`` announced.

    ``announced``: the items this rank puts forward (ranks holding the same media must announce
    disjoint subsets, or an item is encoded twice); ``destinations[i]``: a LongTensor with, for
    each feature row of ``announced[i]`` (``num_tokens`` of them, in order), the rank of ``group``
    that needs it. ``balance``: spread the items over the group by encoder cost (``kind.flops``);
    else each runs on its announcer and no input moves. Every rank of ``group`` calls this once
    per modality and micro-batch, with items or none, in the same order.

    Returns the rows whose destination is this rank, in the canonical order: by announcer rank,
    then the item's index in its announcer's ``announced``, then row within the item.
    Differentiable: their gradients reach the runners' encoders.
    """
    world = dist.get_world_size(group)
    device = next(iter(dummy_inputs.values())).device
    for item, rows in zip(announced, destinations, strict=True):
        if rows.numel() != item.num_tokens or (rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < world):
            raise ValueError(f"an item of {item.num_tokens} feature rows needs as many destinations, each a rank "
                             f"of the {world}-rank group; got {rows.tolist()}")
    counts = [int(c) for c in _all_gather(group, torch.tensor([len(announced)], device=device))]
    keys = list(dummy_inputs)  # the same on every rank, items or not
    table = None
    if balance:  # per item: cost, feature rows, input rows of each key
        table = _all_gather(group, torch.tensor(
            [[kind.flops(encoder, item.inputs), item.num_tokens, *(item.inputs[k].shape[0] for k in keys)]
             for item in announced], dtype=torch.float64, device=device).reshape(len(announced), 2 + len(keys)),
            counts)
        runner = assign_items([t[:, 0].tolist() for t in table])
    else:
        runner = [[announcer] * n for announcer, n in enumerate(counts)]
    to_me = _rows_to_each_rank(group, destinations, counts, device)
    if any(r != announcer for announcer, ranks in enumerate(runner) for r in ranks):
        inputs, run_destinations = _move_items(group, announced, destinations, runner, table, dummy_inputs)
    else:
        inputs = collate_items(list(announced)) if announced else None
        run_destinations = torch.cat([d.to(device) for d in destinations]) if announced else \
            torch.zeros(0, dtype=torch.long, device=device)
    if run_destinations.numel():
        features = encoder(**inputs)
        if features.shape[0] != run_destinations.numel():
            raise ValueError(f"the encoder produced {features.shape[0]} features for items announcing "
                             f"{run_destinations.numel()}")
    else:  # zero rows of the dummy's features: the backward still reaches the encoder's collectives
        features = encoder(**dummy_inputs)[:0]
    order = torch.sort(run_destinations, stable=True).indices  # by destination, keeping (announcer, item, row)
    send_splits = torch.bincount(run_destinations, minlength=world).tolist()
    flat = [(r, to_me[a][i]) for a, ranks in enumerate(runner) for i, r in enumerate(ranks)]  # canonical order
    recv_splits = [sum(n for r, n in flat if r == source) for source in range(world)]
    received = funcol.all_to_all_single_autograd(features[order].contiguous(), recv_splits, send_splits, group)
    return received[_canonical_order(flat, device)]


def _all_gather(group: dist.ProcessGroup, rows: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor | list:
    """Every rank's ``rows``: one tensor [ranks, ...] of the same-shaped ``rows``, or, given each
    rank's row count ``counts``, the list of each rank's rows (padded in transit)."""
    world = dist.get_world_size(group)
    if counts is None:
        gathered = [torch.empty_like(rows) for _ in range(world)]
        dist.all_gather(gathered, rows, group=group)
        return torch.cat(gathered)
    padded = rows.new_zeros((max(counts), *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [table[:n] for table, n in zip(gathered, counts)]


def _rows_to_each_rank(group: dist.ProcessGroup, destinations: Sequence[torch.Tensor], counts: list[int],
                       device: torch.device) -> list[list[int]]:
    """``to_me[a][i]``: how many rows of announcer ``a``'s item ``i`` are destined to this rank
    (each announcer sends every rank one count per item)."""
    world = len(counts)
    per_rank = torch.zeros(world, len(destinations), dtype=torch.long, device=device)  # [destination, item]
    for i, rows in enumerate(destinations):
        per_rank[:, i] = torch.bincount(rows.to(device), minlength=world)
    received = torch.empty(sum(counts), dtype=torch.long, device=device)
    dist.all_to_all_single(received, per_rank.reshape(-1), counts, [len(destinations)] * world, group=group)
    return [chunk.tolist() for chunk in received.split(counts)]


def _move_items(group: dist.ProcessGroup, announced: Sequence[MediaItem], destinations: Sequence[torch.Tensor],
                runner: list[list[int]], table: list[torch.Tensor],
                dummy_inputs: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The collated inputs of the items this rank runs and their rows' destinations, received from
    their announcers in (announcer, item) order; inputs move in the dummy's dtype (the encoder's
    input dtype, which every rank knows)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = runner[rank]
    outgoing = [i for d in range(world) for i, r in enumerate(mine) if r == d]
    incoming = [[i for i, r in enumerate(runner[a]) if r == rank] for a in range(world)]

    def move(per_item: list[torch.Tensor], column: int, template: torch.Tensor) -> torch.Tensor:
        send = (torch.cat([per_item[i] for i in outgoing]).to(template.dtype) if outgoing
                else template.new_empty((0, *template.shape[1:])))
        send_splits = [sum(per_item[i].shape[0] for i, r in enumerate(mine) if r == d) for d in range(world)]
        recv_splits = [int(sum(table[a][i, column] for i in incoming[a])) for a in range(world)]
        received = template.new_empty((sum(recv_splits), *template.shape[1:]))
        dist.all_to_all_single(received, send.contiguous(), recv_splits, send_splits, group=group)
        return received

    inputs = {key: move([item.inputs[key] for item in announced], 2 + j, dummy)
              for j, (key, dummy) in enumerate(dummy_inputs.items())}
    device = next(iter(dummy_inputs.values())).device
    return inputs, move([d.to(device) for d in destinations], 1, torch.zeros(0, dtype=torch.long, device=device))


def _canonical_order(flat: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """``flat``: (runner, rows to this rank) of every announced item in canonical order; rows arrive
    grouped by runner (each runner's in canonical order) -> the index putting them in canonical order."""
    arrival = sorted(range(len(flat)), key=lambda j: flat[j][0])  # stable: canonical order within a runner
    starts, offset = [0] * len(flat), 0
    for j in arrival:
        starts[j], offset = offset, offset + flat[j][1]
    pieces = [torch.arange(start, start + n, device=device) for start, (_, n) in zip(starts, flat)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=device)


class RoutedMediaFn:
    """The ``MediaFn`` over ``route_media``: each row's items are split between the ranks holding
    the row (``peers``: their ranks in ``group``, in row-rank order) by encoder cost, and each rank
    of the row receives the features of the placeholders in its slice (the media entry's
    ``holders``: the row rank of each feature row; absent when the row is not split). With
    ``balance`` the items then spread over the whole ``group`` by cost."""

    def __init__(self, group: dist.ProcessGroup, kinds: Mapping[str, MediaKind],
                 encoder_configs: Mapping[str, Any], peers: Sequence[int], balance: bool) -> None:
        self.group = group
        self.kinds = kinds
        self.encoder_configs = encoder_configs
        self.peers = list(peers)
        self.row_rank = self.peers.index(dist.get_rank(group))
        self.balance = balance

    def __call__(self, name: str, encoder: nn.Module, media: Mapping[str, Any] | None,
                 dummy_inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        kind = self.kinds[name]
        items = kind.split(media["inputs"], self.encoder_configs[name]) if media is not None else []
        rows = sum(item.num_tokens for item in items)
        holders = media.get("holders") if media is not None else torch.zeros(0, dtype=torch.long)
        if holders is None:
            if len(self.peers) > 1:
                raise ValueError(f"{name}: the row is split over {len(self.peers)} ranks but its media entry has "
                                 "no 'holders'; shard the batch with veomni.parallel.row_split.shard_batch")
            holders = torch.zeros(rows, dtype=torch.long)
        holders = holders.cpu()
        announcer = assign_items([[kind.flops(encoder, item.inputs) for item in items]]
                                 + [[] for _ in self.peers[1:]])[0]
        starts = [0, *torch.tensor([item.num_tokens for item in items], dtype=torch.long).cumsum(0).tolist()]
        peers = torch.tensor(self.peers, dtype=torch.long)
        mine = [i for i, a in enumerate(announcer) if a == self.row_rank]
        features = route_media(self.group, kind, encoder, [items[i] for i in mine],
                               [peers[holders[starts[i]:starts[i + 1]]] for i in mine], self.balance, dummy_inputs)
        # canonical order (announcer's group rank, item, row) -> the row order of this slice's positions
        received = [row for a in sorted(range(len(self.peers)), key=self.peers.__getitem__)
                    for i in range(len(items)) if announcer[i] == a
                    for row in range(starts[i], starts[i + 1]) if holders[row] == self.row_rank]
        return features[torch.tensor(received, dtype=torch.long).argsort().to(features.device)]


def check_encoder_balance(model: nn.Module, cfg: ParallelConfig) -> list[str]:
    """Why ``parallel.encoder_balance`` cannot apply to this model and layout (empty when it can)."""
    if not cfg.encoder_balance:
        return []
    if not isinstance(model, MediaHost):
        return [f"parallel.encoder_balance: {type(model).__name__} runs no media encoders; remove the key"]
    split = [f"parallel.{k}={v}" for k, v in (("cp", cfg.cp), ("pp", cfg.pp)) if v > 1]
    if split:
        return [f"parallel.encoder_balance with {', '.join(split)} is not supported yet: the balanced features "
                "would have to reach the ranks holding their context-parallel pieces or pipeline stage; use data "
                "and sequence parallelism (parallel.sp) only, or set parallel.encoder_balance: false"]
    return []


def apply_media_routing(model: nn.Module, meshes: ParallelMeshes, balance: bool) -> None:
    """Install ``RoutedMediaFn`` where media must move: over the sequence-parallel group when rows
    are split (each rank encodes a share of its row's items and receives its slice's features),
    over every rank holding part of the step (``meshes.loss``: dp x sp) with ``balance``; one rank
    and no balancing keeps the local default."""
    if not isinstance(model, MediaHost):
        raise ValueError(f"media routing: {type(model).__name__} runs no media encoders")
    dims = meshes.dims
    if dims.cp > 1:
        raise ValueError("media routing under context parallelism is not supported (check_sequence_parallel)")
    if balance and dims.loss_size > 1:
        mesh = meshes.loss
        first = mesh.get_local_rank() - meshes.sp.get_local_rank()  # loss ranks run (dp, sp), sp innermost
        peers = range(first, first + dims.sp)
    elif dims.sp > 1:
        mesh, peers = meshes.sp, range(dims.sp)
    else:
        logger.info("parallel.encoder_balance: one data-parallel rank, nothing to balance")
        return
    config = model.media_config()
    model.media_fn = RoutedMediaFn(mesh.get_group(), config.media_kinds(), config.encoder_configs, peers, balance)
    logger.info("media encoders (%s) routed over %d ranks: %s", ", ".join(config.encoder_configs), mesh.size(),
                "balanced by encoder cost" if balance else f"split between the {dims.sp} ranks of each row")
