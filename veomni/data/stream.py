"""One source as one consumer reads it: its own share of each epoch's shards, a seeded shuffle
window, and a position that resumes by seeking.

A *consumer* (data-parallel rank x loader worker) reads only the pieces ``epoch_pieces`` gives it
(whole shards, or byte ranges of them when there are fewer shards than consumers), so one epoch
reads every byte once whatever the world size. Records pass through a *window*: the next
``window`` records in read order, permuted with a seed of (seed, source, epoch, first record), so
samples are shuffled across shard boundaries, not only shard by shard. A position names the
window's first record by its byte offset and how many of the window's records (and tokens of the
next one) were passed on: a resumed reader seeks there and re-reads one window, whatever the
position in the epoch.

A position is layout-bound. :meth:`SourceStream.unconsumed` turns the position of a consumer of an
old layout into what it had not passed on, which ``relayout.py`` shares out among the consumers of
a new layout (docs/data.md, "Resume at another layout").
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from veomni.data.shards import Piece, ShardFiles, epoch_pieces
from veomni.data.sources import ReadStats, check_bad_fraction, count_shard_end
from veomni.errors import BadData

Part = tuple[Piece, int]
"""A piece of an epoch's plan and the item offset its first record resumes at (a document's token
offset; 0 but for a record another consumer had partly passed on)."""

Decode = Callable[[Any, int, ReadStats], Iterator[tuple[int, Any]]]
"""(record, first item offset, the epoch's counters) -> ``(item offset, item)`` of one record from
that offset on; nothing for a bad record, which it counts."""


@dataclass(frozen=True)
class StreamPosition:
    """The first item of one source a consumer has not passed on.

    The window holding it starts at byte ``offset`` of piece ``piece`` of the epoch's plan (-1: the
    piece's own start); ``taken`` of its records, in shuffled order, are passed on, and the next
    one resumes at item offset ``item_offset``. The counters are as of that window's start, plus
    the bad records its passed-on part held (a re-read window counts its own records again).
    """

    epoch: int = 0
    piece: int = 0
    offset: int = -1
    taken: int = 0
    item_offset: int = 0
    records_prior_epochs: int = 0
    bad_prior_epochs: int = 0
    records_in_epoch: int = 0
    bad_in_epoch: int = 0


@dataclass(frozen=True)
class Ref:
    """Where one item lives: record at byte ``offset`` of file ``file`` of source ``source``, item
    ``item_offset`` of it. Enough to read the item again without its neighbours."""

    source: str
    file: int
    offset: int
    item_offset: int


@dataclass
class SourceStream:
    """The items of one source for consumer ``consumer`` of ``consumers``, epoch after epoch
    (``train``) or one pass in file order."""

    name: str
    files: ShardFiles
    decode: Decode
    consumer: int
    consumers: int
    seed: int
    train: bool
    shuffle: bool
    window: int
    max_bad_fraction: float
    plans: dict[int, list[Part]] = field(default_factory=dict)
    """Epochs whose plan is given (after a layout change), not derived from the consumer index."""
    end: StreamPosition = field(default_factory=lambda: StreamPosition(epoch=1))
    """Where a finished one-pass (eval) stream stands."""
    stats: ReadStats = field(default_factory=ReadStats)
    """The counts of the pass being read (which files held the bad records)."""

    def plan(self, epoch: int) -> list[Part]:
        """This consumer's pieces of ``epoch``: shard order shuffled per epoch for training."""
        if epoch in self.plans:
            return self.plans[epoch]
        order = list(range(len(self.files.files)))
        if self.train and self.shuffle:
            random.Random(f"{self.seed}:{self.name}:{epoch}").shuffle(order)
        return [(piece, 0) for piece in epoch_pieces(self.files.sizes, order, self.consumers)[self.consumer]]

    def window_order(self, epoch: int, first: tuple[int, int], size: int) -> list[int]:
        """The order a window's records are passed on in, from the file and offset of its first record."""
        order = list(range(size))
        if self.train and self.shuffle and self.window > 1:
            random.Random(f"{self.seed}:{self.name}:{epoch}:{first[0]}:{first[1]}").shuffle(order)
        return order

    def records_from(self, plan: list[Part], piece: int, offset: int,
                     stats: ReadStats) -> Iterator[tuple[int, int, Any]]:
        """``(piece index, offset, record)`` from ``offset`` of ``plan[piece]`` to the plan's end; a
        damaged file skips the rest of its piece, and a whole file's shortfall against the manifest
        (or else the damage, as one record) is counted bad (``count_shard_end``)."""
        for index in range(piece, len(plan)):
            part = plan[index][0]
            if index == piece and offset >= 0:
                part = Piece(part.file, offset, part.end, aligned=True)
            read, damage = 0, None
            try:
                for at, record in self.files.records(part):
                    stats.records += 1
                    read += 1
                    yield index, at, record
            except Exception as error:  # noqa: BLE001 - one damaged shard must not stop a long run
                damage = error
            path = self.files.files[part.file]
            if count_shard_end(stats, path, read, self.files.expected_records(part), damage):
                check_bad_fraction(stats, self.max_bad_fraction, path, end_of_pass=False)

    def items(self, start: StreamPosition) -> Iterator[tuple[Any, StreamPosition, Ref]]:
        """Every item from ``start`` on, each with its own position and ref."""
        pos = start
        while True:
            plan = self.plan(pos.epoch)
            stats = self.stats = ReadStats(pos.records_in_epoch, pos.bad_in_epoch)
            produced = False
            reader = self.records_from(plan, pos.piece, pos.offset, stats)
            skip, item_offset = pos.taken, pos.item_offset
            while True:
                before = (stats.records, stats.bad)
                window = list(islice(reader, max(self.window, 1)))
                if not window:
                    break
                first_piece, first_offset = window[0][0], window[0][1]
                first_file = plan[first_piece][0].file
                order = self.window_order(pos.epoch, (first_file, first_offset), len(window))
                decode_bad = 0
                for k in range(skip, len(window)):
                    index, at, record = window[order[k]]
                    part, resume_at = plan[index]
                    offset = item_offset if k == skip and item_offset else (resume_at if at == part.start else 0)
                    bad_before = stats.bad
                    for item_at, item in self.decode(record, offset, stats):
                        produced = True
                        here = StreamPosition(pos.epoch, first_piece, first_offset, k, item_at,
                                              pos.records_prior_epochs, pos.bad_prior_epochs,
                                              before[0], before[1] + decode_bad)
                        yield item, here, Ref(self.name, part.file, at, item_at)
                    decode_bad += stats.bad - bad_before
                skip, item_offset = 0, 0
            if stats.records:
                check_bad_fraction(stats, self.max_bad_fraction, self.files.files[-1], end_of_pass=True)
            if self.train and pos.epoch not in self.plans and pos.piece == 0 and pos.offset < 0 \
                    and pos.taken == 0 and not produced:
                raise BadData(
                    f"data source {self.name!r}: consumer {self.consumer} of {self.consumers} (data-parallel "
                    f"ranks x loader workers) got no record in a whole epoch: its share of "
                    f"{len(self.files.files)} file(s) holds none; write more, smaller shards or use fewer "
                    "loader workers"
                )
            pos = StreamPosition(pos.epoch + 1, records_prior_epochs=pos.records_prior_epochs + stats.records,
                                 bad_prior_epochs=pos.bad_prior_epochs + stats.bad)
            if not self.train:
                self.end = pos
                return

    def item_at(self, ref: Ref) -> Any:
        """The item ``ref`` names, read on its own (a balancing window restored after a resume)."""
        record = self.files.record_at(ref.file, ref.offset)
        for _, item in self.decode(record, ref.item_offset, ReadStats()):
            return item
        raise BadData(f"data source {self.name!r}: no item at {self.files.files[ref.file]} byte "
                      f"{ref.offset} item {ref.item_offset}; the data changed since the checkpoint")

    def unconsumed(self, pos: StreamPosition, plans: dict[int, list[Part]], consumer: int, consumers: int,
                   epochs: range) -> dict[int, list[Part]]:
        """What the consumer ``consumer`` of ``consumers`` that stood at ``pos`` (with its own given
        ``plans``) had not passed on, per epoch of ``epochs``: whole plans of later epochs, the rest
        of the current one (its window's remaining records one by one, then the bytes after it)."""
        old = SourceStream(self.name, self.files, self.decode, consumer, consumers, self.seed, self.train,
                           self.shuffle, self.window, self.max_bad_fraction, plans)
        out: dict[int, list[Part]] = {}
        for epoch in epochs:
            if epoch > pos.epoch:
                out[epoch] = old.plan(epoch)
            elif epoch == pos.epoch:
                out[epoch] = old.rest_of_epoch(pos)
        return out

    def rest_of_epoch(self, pos: StreamPosition) -> list[Part]:
        plan = self.plan(pos.epoch)
        window = list(islice(self.records_from(plan, pos.piece, pos.offset, ReadStats()), max(self.window, 1)))
        if not window:
            return []
        order = self.window_order(pos.epoch, (plan[window[0][0]][0].file, window[0][1]), len(window))
        rest: list[Part] = []
        for k in range(pos.taken, len(window)):
            index, at, _ = window[order[k]]
            part, resume_at = plan[index]
            offset = pos.item_offset if k == pos.taken and pos.item_offset else (resume_at if at == part.start else 0)
            rest.append((Piece(part.file, at, at + 1), offset))
        last_index, last_at, _ = window[-1]
        last = plan[last_index][0]
        if last_at + 1 < last.end:
            rest.append((Piece(last.file, last_at + 1, last.end, aligned=False), 0))
        return rest + plan[last_index + 1:]
