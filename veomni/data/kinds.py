"""Registry of dataset kinds: what a run reads is chosen by name, like a model family.

A model spec names the kind its family reads (``ModelSpec.dataset``); a recipe may pick another
with ``data.kind``. The engine ships ``packed_text`` (documents -> packed token rows),
``chat_text`` (conversations for supervised fine-tuning, loss on assistant turns), ``chat_preference``
(pairs of replies for the preference objectives), ``chat_media`` (chat samples with media for omni
models), ``graph`` (node classification),
``video_latents`` (latent images and clips -> packed patch rows) and ``video_clips`` (raw clips
encoded on the fly, then packed alike); a plugin package registers its own
kinds next to its model families. Each kind builds a ``ResumableDataset``
(``veomni/data/resume.py``: one resume protocol for every kind, re-exported here).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from veomni.config.schema import DataConfig

# The resume protocol lives in veomni/data/resume.py; a plug-in kind imports it from here or there.
from veomni.data.resume import MERGED_KEY as MERGED_KEY
from veomni.data.resume import ResumableDataset as ResumableDataset
from veomni.data.resume import find_dataset_states as find_dataset_states
from veomni.errors import BadConfig

STEP_STATS = "_step_stats"
"""A micro-batch may carry ``{name: value}`` under this key: what producing it cost (rows read, cache
hits, seconds). The feed (``veomni/data/feed.py``) removes it before the task sees the batch, sums
each value over the step's micro-batches and the data-parallel ranks and reports ``name``; a value
given as a (numerator, denominator) pair is reported as the ratio of the two sums (a hit rate)."""


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
        raise BadConfig(f"unknown dataset kind {name!r}{hint}; registered: {', '.join(sorted(_KINDS))}") from None
