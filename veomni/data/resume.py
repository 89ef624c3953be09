"""The one resume protocol of every dataset kind: a consumer's position, its saved state, and how
the states of an old data-parallel layout carry over to a new one.

Why one module: every kind (text, frames, latents, graph, a plug-in's) used to write the same
bookkeeping again: the loaded start and the current position, a state naming its consumer, the
check that a state is this consumer's, the check of a whole loader's state, finding its own
states inside torchdata's, merging an old layout's states. ``ResumableDataset`` does all of it;
a kind says only what is its own:

- ``state_format``: the ``"format"`` of its states (a new version when their fields change);
- its position: by default ``(epoch, index)``, the index into an epoch's order that every
  consumer shares, saved as ``epoch`` and ``index`` (another position overrides
  ``position_state`` and ``position_from``);
- at another layout, ``merge_positions``: by default the earliest old position, before which
  every consumer had read everything (nothing is skipped, some is seen twice).

It iterates from ``begin()`` and sets ``self._pos`` to the position after each batch it yields.
``ResumableLoader`` is the loader around any of them: it loads a rank's own state, or the
layout-independent ``{MERGED_KEY: ...}`` that ``merge_states`` makes from every old rank's.
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

# torchdata 0.11 calls a torch API that torch 2.13 deprecates, once per iterator; not ours to fix.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)

MERGED_KEY = "veomni_merged_data_position"
"""A loader state holding a layout-independent start position (``ResumableDataset.merge_states``)."""


def find_dataset_states(loader_state: Any, state_format: str) -> list[dict[str, Any]]:
    """Every dataset state (a dict whose ``"format"`` is ``state_format``) nested anywhere in a
    loader state: torchdata's layout of it (per worker, per fetcher) is internal."""
    if isinstance(loader_state, dict):
        if loader_state.get("format") == state_format:
            return [loader_state]
        return [s for value in loader_state.values() for s in find_dataset_states(value, state_format)]
    if isinstance(loader_state, (list, tuple)):
        return [s for value in loader_state for s in find_dataset_states(value, state_format)]
    return []


def check_format(state: dict[str, Any], state_format: str) -> None:
    if state.get("format") != state_format:
        raise ValueError(f"not a {state_format} loader state: {sorted(state)}")


def every_consumer(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One state per old consumer, in consumer order (ranks sharing a data-parallel rank: sequence,
    context, pipeline peers, saved the same one); refuses an incomplete or mixed set."""
    counts = sorted({s["num_consumers"] for s in states})
    unique = {s["consumer"]: s for s in states}
    if len(counts) != 1 or set(unique) != set(range(counts[0])):
        raise ValueError(f"incomplete or mixed loader states: consumers {sorted(unique)} of {counts}; pass the "
                         "states of every rank of the old run")
    return [unique[c] for c in sorted(unique)]


class ResumableDataset(IterableDataset):
    """An iterable of micro-batch dicts for one data-parallel rank whose position is checkpointed.

    Every data-parallel rank and loader worker is one *consumer* (``consumer()``). The state
    travels through torchdata's ``StatefulDataLoader`` protocol: ``state_dict()`` after k
    batches, loaded into a freshly built dataset with the same layout, yields batch k+1 on.
    """

    state_format: ClassVar[str] = ""
    """The ``"format"`` of this kind's states (module docstring)."""
    consumer_bound: ClassVar[bool] = True
    """Whether a state names its consumer (a kind whose ranks all read one stream, like the graph's,
    saves no consumer and loads at any layout its own checks allow)."""
    merge_with: ClassVar[str] = "merge_states"
    """What an error about a state of another layout tells the user to merge it with."""
    tokenizer: Any = None
    """The tokenizer of a text dataset (decoding samples at the end of a run); None otherwise."""

    def __init__(self, dp_rank: int, dp_size: int, fresh: Any = (0, 0)) -> None:
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._fresh = fresh
        self._start = self._pos = fresh

    def consumer(self) -> tuple[int, int]:
        """(this consumer's index, number of consumers), worker-aware."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.dp_rank * workers + worker, self.dp_size * workers

    # ----- the position ---------------------------------------------------------------------
    def begin(self) -> Any:
        """Where the next iteration starts: the loaded or merged position once, else the beginning."""
        start, self._start = self._start, self._fresh
        self._pos = start
        return start

    def resume_at(self, position: Any) -> None:
        """Begin the next iteration at ``position``."""
        self._start = self._pos = position

    def position_state(self) -> dict[str, Any]:
        """The state's fields for the current position ``self._pos``."""
        epoch, index = self._pos
        return {"epoch": epoch, "index": index}

    def position_from(self, state: dict[str, Any]) -> Any:
        """The position a state (or a merged position) holds."""
        return state["epoch"], state["index"]

    # ----- torchdata's state protocol ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"format": self.state_format}
        if self.consumer_bound:
            state["consumer"], state["num_consumers"] = self.consumer()
        return {**state, **self.position_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.resume_at(self.position_from(state))

    def check_state(self, state: dict[str, Any], consumers: int | None = None) -> None:
        """Refuse a state before it is used: another kind's, or one saved at another layout.
        ``consumers``: the loader's count, when the main process checks a whole loader's state
        (a worker knows its own index only inside it); None: the state is this consumer's own."""
        check_format(state, self.state_format)
        if not self.consumer_bound:
            return
        saved, hint = (state["consumer"], state["num_consumers"]), f"merge the old ranks' states with {self.merge_with}"
        if consumers is not None and saved[1] != consumers:
            raise ValueError(f"loader state was saved with {saved[1]} consumers (dp ranks x workers), this loader "
                             f"has {consumers}; {hint}")
        consumer, count = self.consumer()
        if consumers is None and saved != (consumer, count):
            raise ValueError(f"loader state of consumer {saved[0]}/{saved[1]} loaded into consumer {consumer}/{count}: "
                             f"the dp size or data.num_workers changed; {hint}")

    def check_loader_state(self, loader_state: dict[str, Any], consumers: int) -> None:
        """Raise before loading a whole loader's state saved with a different layout (the
        dataset's own state is loaded inside worker processes, where errors read worse)."""
        for state in find_dataset_states(loader_state, self.state_format):
            self.check_state(state, consumers)

    # ----- another layout ----------------------------------------------------------------------
    @classmethod
    def merge_states(cls, loader_states: list[dict[str, Any]]) -> dict[str, Any]:
        """The loader states of every rank of an old run (any layout) -> ``{MERGED_KEY: position}``,
        a state any new layout loads (``start_from``)."""
        found = [s for state in loader_states for s in find_dataset_states(state, cls.state_format)]
        if not found:
            raise ValueError(f"no {cls.state_format} dataset state found in the given loader states")
        return {MERGED_KEY: cls.merge_positions(found)}

    @classmethod
    def merge_positions(cls, states: list[dict[str, Any]]) -> Any:
        """Where every consumer of a new layout starts, from the old consumers' states: it must
        not skip data, it may repeat some. By default the earliest old position."""
        epoch, index = min((s["epoch"], s["index"]) for s in states)
        return {"epoch": epoch, "index": index}

    def start_from(self, merged: Any) -> None:
        """Begin the next iteration at a position made by ``merge_positions``."""
        self.resume_at(self.position_from(merged))


class ResumableLoader(StatefulDataLoader):
    """StatefulDataLoader over a ``ResumableDataset`` that also accepts the layout-independent
    state of its ``merge_states``."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if MERGED_KEY in state_dict:
            super().load_state_dict({})
            self.dataset.start_from(state_dict[MERGED_KEY])
            return
        self.dataset.check_loader_state(state_dict, self.dataset.dp_size * max(self.num_workers, 1))
        super().load_state_dict(state_dict)


def restore_position(loader: ResumableLoader, rank_states: list[dict[str, Any]], same_layout: bool, dp_rank: int,
                     dp_size: int) -> list[list[Any]]:
    """Put ``loader`` where a checkpoint's ranks left it: at the same data-parallel layout this
    rank's own saved state, at another the kind's merge of every old rank's (``merge_states``).
    Returns this rank's balancing window (drawn, not trained): its own, or its share of the old
    ones (``pending_share``)."""
    if same_layout:
        mine = own_state(rank_states, dp_rank)
        state, pending = mine["loader"], mine.get("pending", [])
    else:
        state = type(loader.dataset).merge_states([s["loader"] for s in rank_states])
        pending = pending_share(rank_states, dp_rank, dp_size)
    loader.load_state_dict(state)
    return pending


def own_state(rank_states: list[dict[str, Any]], dp_rank: int) -> dict[str, Any]:
    """The rank state this data-parallel rank saved (its sequence, context and pipeline peers saved
    the same)."""
    return next(s for s in rank_states if s["dp_rank"] == dp_rank)


def pending_share(rank_states: list[dict[str, Any]], dp_rank: int, dp_size: int) -> list[list[Any]]:
    """This rank's share of an old layout's balancing windows (drawn, not trained), dealt round-robin
    over the new data-parallel ranks in old data-parallel order; each old dp rank counted once."""
    old = {state["dp_rank"]: state.get("pending", []) for state in rank_states}
    return [p for rank in sorted(old) for p in old[rank]][dp_rank::dp_size]
