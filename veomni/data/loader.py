"""Packed, resumable text loader: documents -> tokens -> padding-free micro-batches.

Every data-parallel rank and loader worker is one *consumer* ``c`` of ``C = dp_size * workers``
(``c = dp_rank * workers + worker_id``). All consumers read the same deterministic per-epoch
document stream and consumer ``c`` keeps documents ``i`` with ``i % C == c``: a record-level
split that needs no shard metadata and no communication. Each kept document is tokenized, gets
``eos_token_id`` appended, is cut into chunks of ``max_seq_len`` and packed greedily into
micro-batches of at most ``tokens_per_micro_batch`` tokens (see :mod:`veomni.data.packing`).

Resume is exact: the dataset state is the position of the first sample not yet yielded
(epoch, document index, token offset inside that document) plus record counters. The state
travels through torchdata's ``StatefulDataLoader`` protocol, so ``loader.state_dict()`` after k
batches, loaded into a freshly built loader with the same layout, yields batch k+1 onwards.
Skipped documents are read but never tokenized. For a different layout see
:func:`merge_loader_states`. Registered as the ``packed_text`` dataset kind.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchdata.stateful_dataloader import StatefulDataLoader

from veomni.config.schema import DataConfig
from veomni.data.packing import chunk_document, greedy_pack, pack_samples
from veomni.data.registry import (
    MERGED_KEY,
    DatasetKind,
    DatasetRequest,
    ResumableDataset,
    find_dataset_states,
    register_dataset,
)
from veomni.data.sources import ReadStats, iter_texts, resolve_files

if TYPE_CHECKING:  # transformers loads in a second: imported where a tokenizer is loaded, not by every run
    from transformers import PreTrainedTokenizerBase

# torchdata 0.11 calls a torch API that torch 2.13 deprecates, once per iterator; not ours to fix.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)

STATE_FORMAT = "veomni.packed_text.v1"


@dataclass(frozen=True)
class Position:
    """Where a consumer's stream resumes: the first sample not yet yielded, plus counters.

    ``records_in_epoch`` / ``bad_in_epoch`` count the records read in this epoch before
    ``next_doc`` (for reporting: a resumed reader recounts them while re-reading).
    """

    epoch: int = 0
    next_doc: int = 0
    token_offset: int = 0
    records_prior_epochs: int = 0
    bad_prior_epochs: int = 0
    records_in_epoch: int = 0
    bad_in_epoch: int = 0


class PackedTextDataset(ResumableDataset):
    """Iterable of packed micro-batch dicts for one consumer; implements torchdata's state protocol."""

    def __init__(
        self,
        cfg: DataConfig,
        path: str,
        split: str,
        tokenizer: PreTrainedTokenizerBase,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        super().__init__(dp_rank, dp_size)
        problems = check_sample_length(cfg)
        if problems:
            raise ValueError("; ".join(problems))
        self.fmt, self.files = resolve_files(path, cfg.format)
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id; documents need an end-of-text token")
        self.cfg = cfg
        self.split = split
        self.tokenizer = tokenizer
        self.seed = seed
        self._start = Position()
        self._pos = Position()
        self._end = Position(epoch=1)  # eval's position after its pass; _samples adds the counters

    def _epoch_files(self, epoch: int) -> list[Path]:
        """Shard order of one epoch: shuffled with seed and epoch for training, sorted otherwise."""
        files = list(self.files)
        if self.split == "train" and self.cfg.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(files)
        return files

    # ----- what a subclass with another record type overrides (see veomni/data/multimodal.py) -----
    UNIT = ("document", "documents")
    """How the "no usable record in a whole epoch" error names one record and several."""

    def _records(self, files: list[Path], stats: ReadStats, warn: bool) -> Iterator[Any]:
        """One epoch's record stream (every consumer reads the same one)."""
        return iter_texts(files, self.fmt, self.cfg.text_key, self.cfg.max_bad_fraction, stats, warn=warn)

    def _items(self, text: str, first_offset: int, stats: ReadStats) -> Iterator[tuple[int, Any]]:
        """``(token offset, item)`` for the items of one kept record, from ``first_offset`` on:
        the document tokenized, ``eos`` appended, cut into ``max_seq_len`` chunks."""
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return chunk_document(ids, self.cfg.max_seq_len, first_offset)

    def _cost(self, item: Any) -> int:
        """What an item counts against ``tokens_per_micro_batch``."""
        return len(item)

    def _pack(self, items: list[Any]) -> dict:
        """One micro-batch dict from the items packed into it."""
        return pack_samples(items)

    # ----- the shared reader: consumer split, epochs, positions, packing -----------------------
    def _samples(self, start: Position) -> Iterator[tuple[Any, Position]]:
        """This consumer's items from ``start`` on, each tagged with its own position."""
        consumer, consumers = self.consumer()
        prior_records, prior_bad = start.records_prior_epochs, start.bad_prior_epochs
        begin = start
        epoch = start.epoch
        while self.split == "train" or epoch == 0:
            stats = ReadStats()
            produced = False
            records = self._records(self._epoch_files(epoch), stats, warn=consumer == 0)
            for index, record in enumerate(records):
                if index < begin.next_doc or index % consumers != consumer:
                    continue
                first_offset = begin.token_offset if index == begin.next_doc else 0
                for offset, item in self._items(record, first_offset, stats):
                    produced = True
                    counters = (prior_records, prior_bad, stats.records - 1, stats.bad)  # as of this record
                    yield item, Position(epoch, index, offset, *counters)
            if self.split == "train" and begin.next_doc == 0 and not produced:
                one, several = self.UNIT
                raise ValueError(
                    f"consumer {consumer} of {consumers} got no {one} in a whole epoch of "
                    f"{self.files[0].parent}: fewer {several} than dp ranks x workers"
                )
            prior_records += stats.records
            prior_bad += stats.bad
            epoch += 1
            begin = Position(epoch)
        self._end = Position(epoch, 0, 0, prior_records, prior_bad)

    def __iter__(self) -> Iterator[dict]:
        """Start at the loaded position (once), else at the beginning; eval is one pass, train loops."""
        start, self._start = self._start, Position()
        self._pos = start
        return self._batches(start)

    def _batches(self, start: Position) -> Iterator[dict]:
        packed = greedy_pack(self._samples(start), self.cfg.tokens_per_micro_batch, cost=self._cost)
        for items, next_position in packed:
            self._pos = next_position if next_position is not None else self._end
            yield self._pack(items)

    def state_dict(self) -> dict[str, Any]:
        consumer, consumers = self.consumer()
        return {"format": STATE_FORMAT, "consumer": consumer, "num_consumers": consumers, **asdict(self._pos)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a {STATE_FORMAT} loader state: {sorted(state)}")
        consumer, consumers = self.consumer()
        if (state["consumer"], state["num_consumers"]) != (consumer, consumers):
            raise ValueError(
                f"loader state of consumer {state['consumer']}/{state['num_consumers']} loaded into consumer "
                f"{consumer}/{consumers}: the dp size or num_workers changed; use merge_loader_states"
            )
        self._start = self._pos = Position(**{f.name: state[f.name] for f in fields(Position)})

    def start_from(self, merged: dict[str, Any]) -> None:
        """Begin the next iteration at a layout-independent position from :func:`merge_loader_states`."""
        self._start = self._pos = Position(**{f.name: merged[f.name] for f in fields(Position)})

    def check_loader_state(self, loader_state: dict[str, Any], consumers: int) -> None:
        for state in find_dataset_states(loader_state, STATE_FORMAT):
            if state["num_consumers"] != consumers:
                raise ValueError(
                    f"loader state was saved with {state['num_consumers']} consumers (dp ranks x workers), this "
                    f"loader has {consumers}; convert the old ranks' states with merge_loader_states"
                )

    @classmethod
    def merge_states(cls, loader_states: list[dict[str, Any]]) -> dict[str, Any]:
        return merge_loader_states(loader_states)


class PackedDataLoader(StatefulDataLoader):
    """StatefulDataLoader over a ``ResumableDataset`` that also accepts the layout-independent
    state of its ``merge_states``."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if MERGED_KEY in state_dict:
            super().load_state_dict({})
            self.dataset.start_from(state_dict[MERGED_KEY])
            return
        self.dataset.check_loader_state(state_dict, self.dataset.dp_size * max(self.num_workers, 1))
        super().load_state_dict(state_dict)


def merge_loader_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Turn the per-rank loader states of an old run (any dp size / workers) into one start position.

    Rule: every consumer has yielded all its documents before its own ``next_doc``, so every
    document before the smallest ``(epoch, next_doc)`` over all old consumers was consumed by
    someone. The merged state starts all new consumers there (token offset 0), so no document
    is skipped; the documents between that position and each old consumer's own position are
    seen again (a few per old consumer when their documents were of similar length; the spread
    grows when document lengths fell unevenly). Counters come from the earliest consumer.
    Pass the states of *all* old ranks; any new layout loads the result with
    ``loader.load_state_dict(merged)``.
    """
    found = [s for state in states for s in find_dataset_states(state, STATE_FORMAT)]
    if not found:
        raise ValueError("no packed-text dataset state found in the given loader states")
    consumers = {s["num_consumers"] for s in found}
    seen = {s["consumer"] for s in found}
    if len(consumers) != 1 or seen != set(range(consumers.pop())):
        raise ValueError(
            f"incomplete or mixed loader states: consumers {sorted(seen)} of {sorted(consumers)}; "
            "pass the states of every rank of the old run"
        )
    earliest = min(found, key=lambda s: (s["epoch"], s["next_doc"]))
    position = replace(Position(**{f.name: earliest[f.name] for f in fields(Position)}), token_offset=0)
    return {MERGED_KEY: asdict(position)}


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Load a tokenizer folder offline; fail clearly when it is missing or has no eos token."""
    folder = Path(path)
    if (
        not path
        or not (folder / "tokenizer.json").is_file()
        and not (folder / "tokenizer_config.json").is_file()
    ):
        raise FileNotFoundError(f"tokenizer folder {path!r} not found (expected tokenizer.json inside)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {path!r} defines no eos_token")
    return tokenizer


def check_sample_length(cfg: DataConfig) -> list[str]:
    """Documents are cut into samples of at most ``data.max_seq_len`` tokens (at least a token and
    its next-token target), and a sample must fit one micro-batch."""
    if cfg.max_seq_len < 2:
        return [f"data.max_seq_len ({cfg.max_seq_len}) must be >= 2: a sample needs a token and its target"]
    if cfg.tokens_per_micro_batch < cfg.max_seq_len:
        return [f"data.tokens_per_micro_batch ({cfg.tokens_per_micro_batch}) must be >= data.max_seq_len "
                f"({cfg.max_seq_len}) so that every sample fits a micro-batch"]
    return []


def check_text_data(cfg: DataConfig, model_config: Any) -> list[str]:
    """A text dataset's samples fit its micro-batches, and its tokenizer fits the model's vocabulary."""
    return check_sample_length(cfg) + _check_tokenizer(cfg, model_config)


def _check_tokenizer(cfg: DataConfig, model_config: Any) -> list[str]:
    folder = Path(cfg.tokenizer) if cfg.tokenizer else None
    if folder is None or not folder.is_dir():
        return [f"data.tokenizer: tokenizer folder not found: {cfg.tokenizer or '(unset)'}"]
    vocab = getattr(model_config, "vocab_size", None)
    if vocab is None:
        return [f"data.kind reads token ids, but the model config {type(model_config).__name__} has no vocab_size"]
    from transformers import AutoTokenizer

    size = len(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
    if size > vocab:
        return [f"model.vocab_size={vocab} is smaller than the tokenizer's {size} tokens ({cfg.tokenizer}); "
                "raise model.vocab_size"]
    return []


def _build_packed_text(request: DatasetRequest) -> PackedTextDataset:
    r = request
    return PackedTextDataset(r.cfg, r.path, r.split, r.tokenizer, r.dp_rank, r.dp_size, r.seed)


register_dataset(DatasetKind("packed_text", _build_packed_text, needs_tokenizer=True, check=check_text_data))
