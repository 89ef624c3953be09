"""Resume at another layout: what the readers of an old data-parallel layout had not passed on,
shared out exactly among the readers of the new one.

Each old reader stood at a position per source (``stream.StreamPosition``). What it had not
passed on is, per epoch: the rest of its window as single records (with a partly used document's
token offset), then the bytes after the window, then its whole later epochs
(``SourceStream.unconsumed``). Each new reader takes an equal share of those *parts* as its plan
for those epochs, then goes on with the plans of its own layout: within the epochs the old readers
were in, every sample is passed on once, none twice and none skipped.
"""

from __future__ import annotations

from typing import Any

from veomni.data.kinds import MERGED_KEY, find_dataset_states
from veomni.data.shards import Piece, split_pieces
from veomni.data.stream import Part, SourceStream, StreamPosition


def merge_states(states: list[dict[str, Any]], state_format: str) -> dict[str, Any]:
    """Every old reader's state of ``state_format`` found in the per-rank loader states, once each
    (ranks sharing a data-parallel rank: sequence, context, pipeline peers, saved the same one);
    refuses an incomplete or mixed set."""
    found = [s for state in states for s in find_dataset_states(state, state_format)]
    if not found:
        raise ValueError(f"no {state_format} dataset state found in the given loader states")
    consumers = {s["num_consumers"] for s in found}
    unique = {s["consumer"]: s for s in found}
    if len(consumers) != 1 or set(unique) != set(range(consumers.pop())):
        counts = sorted({s["num_consumers"] for s in found})
        raise ValueError(f"incomplete or mixed loader states: consumers {sorted(unique)} of {counts}; pass the "
                         "states of every rank of the old run")
    return {MERGED_KEY: {"format": state_format, "states": [unique[c] for c in sorted(unique)]}}


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
