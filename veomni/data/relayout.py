"""Resume at another layout: what the readers of an old data-parallel layout had not passed on,
shared out exactly among the readers of the new one.

Each old reader stood at a position per source (``stream.StreamPosition``). What it had not
passed on is, per epoch: the rest of its window as single records (with a partly used document's
token offset), then the bytes after the window, then its whole later epochs
(``SourceStream.unconsumed``). Each new reader takes an equal share of those *parts* as its plan
for those epochs, then goes on with the plans of its own layout: within the epochs the old readers
were in, every sample is passed on once, none twice and none skipped. The old readers' states
reach here through the resume protocol (``veomni/data/resume.py``, ``PackedTextDataset.merge_positions``).
"""

from __future__ import annotations

from typing import Any

from veomni.data.shards import Piece, split_pieces
from veomni.data.stream import Part, SourceStream, StreamPosition


def new_plans(stream: SourceStream, old_states: list[dict[str, Any]], consumer: int,
              consumers: int) -> tuple[StreamPosition, dict[int, list[Part]]]:
    """Where a new reader starts one source, and its plans for the epochs the old readers were in."""
    mine = [s for s in old_states if stream.name in s["sources"]]
    if not mine:
        return StreamPosition(), {}
    olds = [StreamPosition(**s["sources"][stream.name]) for s in mine]
    epochs = range(min(p.epoch for p in olds), max(p.epoch for p in olds) + 1)
    leftover: dict[int, list[Part]] = {e: [] for e in epochs}
    for state, pos in zip(mine, olds):
        plans = plans_from_rows(state["plans"].get(stream.name, {}))
        for epoch, parts in stream.unconsumed(pos, plans, state["consumer"], state["num_consumers"], epochs).items():
            leftover[epoch] += parts
    return StreamPosition(epoch=epochs.start), {e: share_parts(parts, consumer, consumers)
                                                for e, parts in leftover.items()}


def share_parts(parts: list[Part], consumer: int, consumers: int) -> list[Part]:
    """Consumer ``consumer``'s share of leftover parts: single records dealt round-robin, byte ranges
    cut into equal contiguous runs (``split_pieces``)."""
    records = [p for p in parts if p[0].end - p[0].start == 1]
    ranges = [p[0] for p in parts if p[0].end - p[0].start != 1]
    mine = records[consumer::consumers]
    return mine + [(piece, 0) for piece in split_pieces(ranges, consumers)[consumer]]


def plans_to_rows(plans: dict[int, list[Part]]) -> dict[int, list[list[Any]]]:
    return {epoch: [[p.file, p.start, p.end, p.aligned, at] for p, at in parts] for epoch, parts in plans.items()}


def plans_from_rows(rows: dict[Any, list[list[Any]]]) -> dict[int, list[Part]]:
    return {int(epoch): [(Piece(int(f), int(a), int(b), bool(aligned)), int(at)) for f, a, b, aligned, at in parts]
            for epoch, parts in rows.items()}
