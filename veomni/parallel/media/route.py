"""Routing encoder work and its features between ranks: ``route_media``, the one core under
balanced encoder work, omni models under LLM sequence parallelism and long-short sequence
parallel encoders.

Each rank of a group *announces* some items and says, per feature row of each, which rank of the
group needs it (its *destination*). Then, on every rank of the group:

1. the item counts are all-gathered; with balancing or long items, the items' encoder prices
   (``MediaKind.flops`` on the item), row counts and long flags (more encoder sequence rows than
   ``LongItems.threshold``) too, and every rank computes the same assignment
   (``media_assign.assign_work``: long items onto blocks of ranks, short ones longest first onto
   the least-loaded rank); without either, each item runs on its announcer;
2. each announcer tells every destination how many rows of each of its items it will get, per
   member chunk of a long item (an all-to-all of counts);
3. items whose runners are not their announcer travel there with their rows' destinations
   (uneven ``all_to_all_single``; a long item goes to every member of its block; skipped by every
   rank when nothing moves);
4. each rank runs the encoder once on its short items and, when the group has long items at all,
   once more on its block's long items packed together, sequence-parallel over the block
   (``encoder_sp.run_encoder_share``: each member returns a contiguous chunk of the pack's
   features); a rank with nothing to run runs the dummy input and keeps zero rows of its
   features, so every rank makes the same encoder calls (FSDP's collectives match) and joins
   their backward;
5. every feature row goes to its destination with a differentiable all-to-all
   (``all_to_all_single_autograd``): the gradients of the rows travel back to the encoder that
   made them.

Items are independent inside an encoder (the ViT attends within a frame, the audio encoder within
a clip) and a sequence-parallel run computes each row as a whole run would, so each item's
features, and the gradients they send back into the encoder weights, are the ones its owner would
have computed itself (``tests/parallel/test_colocate.py``, ``tests/parallel/test_media_sp.py``,
``tests/recipes/test_long_short.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from veomni.contract.media import MediaItem, collate_items
from veomni.parallel.media.assign import Recipients, assign_work, block_chunks
from veomni.parallel.media.encoder_sp import is_long_item, run_encoder_share

Key = tuple[int, int]
"""An item by (announcer rank, index in its announcer's list): the canonical order."""


@dataclass(frozen=True)
class LongItems:
    """Long-short sequence parallelism: items with more than ``threshold`` encoder sequence rows
    run over a block of ``size`` consecutive ranks of the routing group; ``block`` is this rank's
    block, a process group whose rank ``m`` is routing rank ``block_start + m``."""

    threshold: int
    size: int
    block: dist.ProcessGroup


def route_media(group: dist.ProcessGroup, encoder: nn.Module, announced: Sequence[MediaItem],
                costs: Sequence[float], destinations: Sequence[torch.Tensor], balance: bool,
                dummy_inputs: Mapping[str, torch.Tensor], long: LongItems | None = None,
                loads: Sequence[float] | None = None) -> torch.Tensor:
    """The feature rows destined to this rank, encoded from the items every rank of ``group`` announced.

    ``announced``: the items this rank puts forward (ranks holding the same media must announce
    disjoint subsets, or an item is encoded twice), ``costs[i]`` the encoder cost of ``announced[i]``
    (its kind's ``flops``, priced once by the caller); ``destinations[i]``: a LongTensor with, for
    each feature row of ``announced[i]`` (``num_tokens`` of them, in order), the rank of ``group``
    that needs it. ``balance``: spread the short items over the group by those costs; else each
    runs on its announcer. ``long``: run long items sequence-parallel over blocks of ranks.
    ``loads``: other work each rank of ``group`` has in the step (a pipeline stage's), which the
    placement fills around. Every rank of ``group`` calls this once per modality and micro-batch,
    with items or none, in the same order and with the same ``balance``, ``long`` and ``loads``.

    Returns the rows whose destination is this rank, in the canonical order: by announcer rank,
    then the item's index in its announcer's ``announced``, then row within the item.
    Differentiable: their gradients reach the runners' encoders.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = next(iter(dummy_inputs.values())).device
    for item, rows in zip(announced, destinations, strict=True):
        if rows.numel() != item.num_tokens or (rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < world):
            raise ValueError(f"an item of {item.num_tokens} feature rows needs as many destinations, each a rank "
                             f"of the {world}-rank group; got {rows.tolist()}")
    if long is not None and dist.get_rank(long.block) != rank % long.size:
        raise ValueError("LongItems.block must hold consecutive ranks of the routing group, in order")
    counts = [int(c) for c in _all_gather(group, torch.tensor([len(announced)], device=device))]
    keys = list(dummy_inputs)  # the same on every rank, items or not
    size = long.size if long is not None else 1
    table = None
    if balance or long is not None:  # per item: cost, feature rows, input rows of each key, long flag
        rows = [[cost, item.num_tokens, *(item.inputs[k].shape[0] for k in keys),
                 float(long is not None and is_long_item(encoder, item.inputs, long.threshold))]
                for item, cost in zip(announced, costs, strict=True)]
        table = _all_gather(group, torch.tensor(rows, dtype=torch.float64, device=device).reshape(
            len(announced), 3 + len(keys)), counts)
        recipients = assign_work([t[:, 0].tolist() for t in table], [t[:, -1].bool().tolist() for t in table],
                                 size, balance, loads)
    else:
        recipients = [[(announcer,)] * n for announcer, n in enumerate(counts)]
    chunks = _long_chunks(recipients, table, size)
    to_me = _rows_to_each_rank(group, destinations, [chunks.get((rank, i)) for i in range(len(announced))],
                               counts, size, device)
    if any(r != (announcer,) for announcer, ranks in enumerate(recipients) for r in ranks):
        held, pieces, held_destinations = _move_items(group, announced, destinations, recipients, table, dummy_inputs)
    else:
        held = [(rank, i) for i in range(len(announced))]
        pieces, held_destinations = [item.inputs for item in announced], [d.to(device) for d in destinations]
    whole = [j for j, (a, i) in enumerate(held) if len(recipients[a][i]) == 1]
    parts = [_encode(encoder, [pieces[j] for j in whole], [held_destinations[j] for j in whole], dummy_inputs)]
    if chunks:  # the group has long items: every rank makes the second call
        packed = [j for j, (a, i) in enumerate(held) if len(recipients[a][i]) > 1]
        parts.append(_encode_share(long, encoder, [pieces[j] for j in packed],
                                   [held_destinations[j] for j in packed], dummy_inputs))
    features = torch.cat([f for f, _ in parts])
    run_destinations = torch.cat([d for _, d in parts])
    order = torch.sort(run_destinations, stable=True).indices  # by destination, keeping the run order
    send_splits = torch.bincount(run_destinations, minlength=world).tolist()
    arrival = _arrival(recipients, to_me, world)
    recv_splits = [sum(n for source, _, n in arrival if source == s) for s in range(world)]
    received = funcol.all_to_all_single_autograd(features[order].contiguous(), recv_splits, send_splits, group)
    return received[_canonical_order(arrival, device)]


def _encode(encoder: nn.Module, inputs: list[Mapping[str, torch.Tensor]], destinations: list[torch.Tensor],
            dummy_inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(features, destinations) of the whole items this rank runs, in one encoder call."""
    if not inputs:  # zero rows of the dummy's features: the backward still reaches the encoder's collectives
        return encoder(**dummy_inputs)[:0], _no_rows(dummy_inputs)
    rows = torch.cat(destinations)
    features = encoder(**_collate(inputs))
    if features.shape[0] != rows.numel():
        raise ValueError(f"the encoder produced {features.shape[0]} features for items announcing {rows.numel()}")
    return features, rows


def _encode_share(long: LongItems, encoder: nn.Module, inputs: list[Mapping[str, torch.Tensor]],
                  destinations: list[torch.Tensor], dummy_inputs: Mapping[str, torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(this member's chunk of features, their destinations) of its block's long items, packed."""
    if not inputs:
        return encoder(**dummy_inputs)[:0], _no_rows(dummy_inputs)
    rows = torch.cat(destinations)
    member = dist.get_rank(long.block)
    start = sum(block_chunks([rows.numel()], long.size)[0][:member])
    features = run_encoder_share(long.block, encoder, _collate(inputs))
    return features, rows[start:start + features.shape[0]]


def _collate(inputs: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return collate_items([MediaItem(dict(piece), 0, 0) for piece in inputs])


def _no_rows(dummy_inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.zeros(0, dtype=torch.long, device=next(iter(dummy_inputs.values())).device)


def _long_chunks(recipients: list[list[Recipients]], table: list[torch.Tensor] | None,
                 size: int) -> dict[Key, list[int]]:
    """Each long item's rows in each member's chunk of its block's pack (canonical order)."""
    blocks: dict[Recipients, list[Key]] = {}
    for announcer, ranks in enumerate(recipients):
        for index, runners in enumerate(ranks):
            if len(runners) > 1:
                blocks.setdefault(runners, []).append((announcer, index))
    chunks = {}
    for items in blocks.values():
        rows = block_chunks([int(table[a][i, 1]) for a, i in items], size)
        chunks.update(zip(items, rows))
    return chunks


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


def _rows_to_each_rank(group: dist.ProcessGroup, destinations: Sequence[torch.Tensor],
                       chunks: list[list[int] | None], counts: list[int], size: int,
                       device: torch.device) -> list[list[list[int]]]:
    """``to_me[a][i][m]``: how many rows of announcer ``a``'s item ``i`` in member ``m``'s chunk
    are destined to this rank (a whole item is its own chunk 0); each announcer sends every rank
    ``size`` counts per item. ``chunks[i]``: this rank's item ``i``'s rows per chunk, None: whole."""
    world = len(counts)
    per_rank = torch.zeros(world, len(destinations), size, dtype=torch.long, device=device)  # [destination, item, m]
    for i, rows in enumerate(destinations):
        for m, piece in enumerate(rows.to(device).split(chunks[i] or [rows.numel()])):
            per_rank[:, i, m] = torch.bincount(piece, minlength=world)
    received = torch.empty(sum(counts) * size, dtype=torch.long, device=device)
    dist.all_to_all_single(received, per_rank.reshape(-1), [n * size for n in counts],
                           [len(destinations) * size] * world, group=group)
    return [chunk.reshape(-1, size).tolist() for chunk in received.split([n * size for n in counts])]


def _move_items(group: dist.ProcessGroup, announced: Sequence[MediaItem], destinations: Sequence[torch.Tensor],
                recipients: list[list[Recipients]], table: list[torch.Tensor],
                dummy_inputs: Mapping[str, torch.Tensor]
                ) -> tuple[list[Key], list[dict[str, torch.Tensor]], list[torch.Tensor]]:
    """The items this rank runs (canonical order), each one's inputs and its rows' destinations,
    received from their announcers; inputs move in the dummy's dtype (the encoder's input dtype,
    which every rank knows)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = recipients[rank]
    outgoing = [i for d in range(world) for i, runners in enumerate(mine) if d in runners]
    held = [(a, i) for a in range(world) for i, runners in enumerate(recipients[a]) if rank in runners]

    def move(per_item: list[torch.Tensor], column: int, template: torch.Tensor) -> list[torch.Tensor]:
        send = (torch.cat([per_item[i] for i in outgoing]).to(template.dtype) if outgoing
                else template.new_empty((0, *template.shape[1:])))
        send_splits = [sum(per_item[i].shape[0] for i, runners in enumerate(mine) if d in runners)
                       for d in range(world)]
        sizes = [int(table[a][i, column]) for a, i in held]
        recv_splits = [sum(n for (a, _), n in zip(held, sizes) if a == source) for source in range(world)]
        received = template.new_empty((sum(recv_splits), *template.shape[1:]))
        dist.all_to_all_single(received, send.contiguous(), recv_splits, send_splits, group=group)
        return list(received.split(sizes))

    inputs = {key: move([item.inputs[key] for item in announced], 2 + j, dummy)
              for j, (key, dummy) in enumerate(dummy_inputs.items())}
    device = next(iter(dummy_inputs.values())).device
    moved = move([d.to(device) for d in destinations], 1, torch.zeros(0, dtype=torch.long, device=device))
    return held, [{key: inputs[key][j] for key in inputs} for j in range(len(held))], moved


def _arrival(recipients: list[list[Recipients]], to_me: list[list[list[int]]],
             world: int) -> list[tuple[int, tuple[int, int, int], int]]:
    """The segments of rows this rank receives, in arrival order: (sender, (announcer, item,
    chunk), rows). A sender sends its whole items' rows, then its chunk of its block's long items,
    each in canonical order (the stable sort by destination keeps that order)."""
    items = [(a, i, runners) for a, ranks in enumerate(recipients) for i, runners in enumerate(ranks)]
    arrival = []
    for sender in range(world):
        arrival += [(sender, (a, i, 0), to_me[a][i][0]) for a, i, runners in items if runners == (sender,)]
        arrival += [(sender, (a, i, runners.index(sender)), to_me[a][i][runners.index(sender)])
                    for a, i, runners in items if len(runners) > 1 and sender in runners]
    return arrival


def _canonical_order(arrival: list[tuple[int, tuple[int, int, int], int]], device: torch.device) -> torch.Tensor:
    """The index putting rows received in ``arrival`` order into canonical (announcer, item,
    chunk, row) order."""
    starts, offset = {}, 0
    for _, segment, rows in arrival:
        starts[segment], offset = offset, offset + rows
    pieces = [torch.arange(starts[segment], starts[segment] + rows, device=device)
              for _, segment, rows in sorted(arrival, key=lambda s: s[1])]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=device)
