"""Registry of dataset kinds: what a run reads is chosen by name, like a model family.

A model spec names the kind its family reads (``ModelSpec.dataset``); a recipe may pick another
with ``data.kind``. The engine ships ``packed_text`` (documents -> packed token rows),
``chat_media`` (chat samples with media for omni models), ``graph`` (node classification),
``video_latents`` (latent images and clips -> packed patch rows) and ``video_clips`` (raw clips
encoded on the fly, then packed alike); a plugin package registers its own
kinds next to its model families. Each kind builds a ``ResumableDataset``, which owns its
resume state (and how states of an old data-parallel layout merge into a new one).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from veomni.config.schema import DataConfig

MERGED_KEY = "veomni_merged_data_position"
"""A loader state holding a layout-independent start position (``ResumableDataset.merge_states``)."""


class ResumableDataset(IterableDataset):
    """An iterable of micro-batch dicts for one data-parallel rank whose position is checkpointed.

    Every data-parallel rank and loader worker is one *consumer* (``consumer()``). The state
    travels through torchdata's ``StatefulDataLoader`` protocol: ``state_dict()`` after k
    batches, loaded into a freshly built dataset with the same layout, yields batch k+1 on.
    """

    tokenizer: Any = None
    """The tokenizer of a text dataset (decoding samples at the end of a run); None otherwise."""

    def __init__(self, dp_rank: int, dp_size: int) -> None:
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def consumer(self) -> tuple[int, int]:
        """(this consumer's index, number of consumers), worker-aware."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.dp_rank * workers + worker, self.dp_size * workers

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def check_loader_state(self, loader_state: dict[str, Any], consumers: int) -> None:
        """Raise before loading a whole loader's state saved with a different layout (the
        dataset's own state is loaded inside worker processes, where errors read worse)."""

    @classmethod
    def merge_states(cls, loader_states: list[dict[str, Any]]) -> dict[str, Any]:
        """The loader states of every rank of an old run (any layout) -> ``{MERGED_KEY: position}``,
        a state any new layout loads; the dataset must not skip data, it may repeat some."""
        raise ValueError(f"{cls.__name__} cannot resume at a different data-parallel layout or worker count")

    def start_from(self, merged: dict[str, Any]) -> None:
        """Begin the next iteration at a position made by ``merge_states``."""
        raise NotImplementedError


def find_dataset_states(loader_state: Any, state_format: str) -> list[dict[str, Any]]:
    """Every dataset state (a dict whose ``"format"`` is ``state_format``) nested anywhere in a
    loader state: torchdata's layout of it (per worker, per fetcher) is internal, so a dataset's
    ``merge_states`` and ``check_loader_state`` find their own states with this."""
    if isinstance(loader_state, dict):
        if loader_state.get("format") == state_format:
            return [loader_state]
        return [s for value in loader_state.values() for s in find_dataset_states(value, state_format)]
    if isinstance(loader_state, (list, tuple)):
        return [s for value in loader_state for s in find_dataset_states(value, state_format)]
    return []


@dataclass(frozen=True)
class DatasetRequest:
    """Everything a dataset kind builds from."""

    cfg: DataConfig
    path: str
    split: str
    """``train`` (loops over epochs) or ``eval`` (one pass, in order)."""
    tokenizer: Any
    dp_rank: int
    dp_size: int
    seed: int
    model_config: Any
    micro_batches: int = 1
    """Micro-batches per rank per optimizer step (``train.grad_accum``): a graph kind cuts each
    epoch into this many chunks."""


def _no_problems(cfg: DataConfig, model_config: Any) -> list[str]:
    return []


def _no_plan_problems(cfg: DataConfig) -> list[str]:
    return []


@dataclass(frozen=True)
class DatasetKind:
    name: str
    build: Callable[[DatasetRequest], ResumableDataset]
    needs_tokenizer: bool = False
    """Whether ``data.tokenizer`` must name a tokenizer folder (loaded by the engine)."""
    check: Callable[[DataConfig, Any], list[str]] = _no_problems
    """(data config, model config) -> problems found before any worker starts (cheap checks that
    read the data, its manifests or the tokenizer)."""
    check_plan: Callable[[DataConfig], list[str]] = _no_plan_problems
    """data config -> problems found from the recipe alone: a dry run makes them on a
    machine without the data."""
    balances: bool = False
    """Whether the kind reads ``data.sources`` mixtures and yields single samples for ``data.balance``
    (a ``PackedTextDataset``)."""


_KINDS: dict[str, DatasetKind] = {}


def register_dataset(kind: DatasetKind) -> DatasetKind:
    existing = _KINDS.get(kind.name)
    if existing is not None and existing != kind:
        raise ValueError(f"dataset kind {kind.name!r} is already registered")
    _KINDS[kind.name] = kind
    return kind


def get_dataset_kind(name: str) -> DatasetKind:
    try:
        return _KINDS[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(_KINDS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown dataset kind {name!r}{hint}; registered: {', '.join(sorted(_KINDS))}") from None
