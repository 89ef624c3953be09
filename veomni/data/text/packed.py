"""Packed, resumable text loader: documents -> tokens -> padding-free micro-batches.

Every data-parallel rank and loader worker is one *consumer* ``c`` of ``C = dp_size * workers``
(``c = dp_rank * workers + worker_id``). Each source is read as :mod:`veomni.data.stream` says:
consumer ``c`` reads only its own shards or byte ranges of them (one pass over the data per epoch
whatever ``C``), through a seeded shuffle window. Several sources (``data.sources``) are mixed
per sample by weight (:mod:`veomni.data.mixture`). Each document is tokenized, gets
``eos_token_id`` appended, is cut into chunks of ``max_seq_len`` and packed greedily into
micro-batches of at most ``tokens_per_micro_batch`` tokens (see :mod:`veomni.data.packing`);
each training micro-batch also says how many of its samples came from each source
(``SOURCE_COUNTS``).

Resume is exact and costs one window per source, not a re-read of the epoch: the position is, per
source, the position of the first sample not yet yielded, plus the mixture's counts. The protocol
around it is ``ResumableDataset``'s (``veomni/data/resume.py``): ``loader.state_dict()`` after k
batches, loaded into a freshly built loader with the same layout, yields batch k+1 onwards. At
another layout ``merge_positions`` keeps every old consumer's state and each new consumer takes an
exact share of what they had not read (``veomni/data/relayout.py``). Registered as the
``packed_text`` dataset kind.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from veomni.config.schema import DataConfig
from veomni.data.kinds import DatasetKind, DatasetRequest, ResumableDataset, register_dataset
from veomni.data.mixture import SourceSpec, check_sources, next_source, run_sources, source_files
from veomni.data.packing import chunk_document, greedy_pack, pack_samples
from veomni.data.relayout import new_plans, plans_from_rows, plans_to_rows
from veomni.data.resume import check_format, every_consumer
from veomni.data.shards import ShardFiles
from veomni.data.sources import ReadStats, count_bad, record_text
from veomni.data.stream import Part, Ref, SourceStream, StreamPosition
from veomni.errors import BadConfig, BadData, MissingInput

if TYPE_CHECKING:  # transformers loads in a second: imported where a tokenizer is loaded, not by every run
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

STATE_FORMAT = "veomni.packed_text.v2"
SOURCE_COUNTS = "source_counts"
"""Batch key: ``{source name: samples of this micro-batch drawn from it}`` (the trainer reports the
realised mixture from it and removes it before the task sees the batch)."""
ALL_BAD = 0.999
READ_COUNTS = "read_counts"
"""Batch key: its consumer's ``read_counts()``, while the run counts bad records (removed by the feed)."""


@dataclass(frozen=True)
class Position:
    """Where a consumer resumes: every source's stream position and the mixture's counts since its
    weights were set."""

    sources: tuple[StreamPosition, ...]
    counts: tuple[int, ...]


@dataclass(frozen=True)
class Drawn:
    """One sample as the mixture passed it on: the kind's item, where it lives, its source's index."""

    item: Any
    ref: Ref
    source: int


class PackedTextDataset(ResumableDataset):
    """Iterable of packed micro-batch dicts for one consumer (its position: ``Position``)."""

    state_format = STATE_FORMAT
    merge_with = "merge_loader_states"

    def __init__(
        self,
        cfg: DataConfig,
        split: str,
        tokenizer: PreTrainedTokenizerBase,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        problems = check_sample_length(cfg)
        if problems:
            raise BadConfig("; ".join(problems))
        if tokenizer.eos_token_id is None:
            raise BadData("the tokenizer has no eos_token_id; documents need an end-of-text token")
        self.cfg = cfg
        self.split = split
        self.tokenizer = tokenizer
        self.seed = seed
        self.specs: list[SourceSpec] = run_sources(cfg, split)
        self.files: list[ShardFiles] = [source_files(spec, split) for spec in self.specs]
        self.formats = {spec.name: files.fmt for spec, files in zip(self.specs, self.files)}
        self.weights = [spec.weight for spec in self.specs]
        fresh = Position(tuple(StreamPosition() for _ in self.specs), tuple(0 for _ in self.specs))
        super().__init__(dp_rank, dp_size, fresh)
        self.unpacked = False
        """Yield single drawn samples instead of packed micro-batches (set by a balancing feed)."""
        self.run_counts_bad = False
        """The run, not this consumer, acts on ``data.max_bad_fraction`` (set by the trainer's feed, which
        sums every rank's counts, ``READ_COUNTS``): the consumer's own check then never stops it."""
        self._merged: list[dict[str, Any]] | None = None
        """Every old consumer's state after a layout change, resolved into a start when iterated."""
        self._end = replace(fresh, sources=tuple(StreamPosition(epoch=1) for _ in self.specs))
        self._plans: dict[str, dict[int, list[Part]]] = {}
        self._live: list[SourceStream] = []  # the streams being read (their pass's counts)

    @property
    def max_bad_fraction(self) -> float:
        """The bad share of this consumer's records that stops it: ``data.max_bad_fraction``, or, while
        the run checks the sum over its ranks (``run_counts_bad``), only a consumer whose records are
        all but ``ALL_BAD`` bad: it would yield no batch for that check to see."""
        return max(ALL_BAD, self.cfg.max_bad_fraction) if self.run_counts_bad else self.cfg.max_bad_fraction

    def read_counts(self) -> list[Any]:
        """``[records passed on, the bad among them, 1 once a pass is finished else 0, the file of the
        current passes with the most bad records, their count]`` of this consumer's sources so far, as
        its position counts them (``StreamPosition``: a window's records up to ``taken``)."""
        sources = self._pos.sources
        worst = max((stream.stats.bad_by_file.most_common(1)[0] for stream in self._live
                     if stream.stats.bad_by_file), key=lambda found: found[1], default=("", 0))
        return [sum(s.records_prior_epochs + s.records_in_epoch + s.taken for s in sources),  # as bad_in_epoch counts
                sum(s.bad_prior_epochs + s.bad_in_epoch for s in sources), int(max(s.epoch for s in sources) > 0),
                *worst]

    @property
    def bytes_read(self) -> int:
        """Bytes this consumer has read from its sources' files (data, headers, index scans)."""
        return sum(files.bytes_read for files in self.files)

    # ----- what a subclass with another record type overrides (see veomni/data/chat/media_dataset.py) -----
    def _items(self, record: Any, spec: SourceSpec, first_offset: int, stats: ReadStats) -> Iterator[tuple[int, Any]]:
        """``(token offset, item)`` for the items of one record, from ``first_offset`` on: the document
        tokenized, ``eos`` appended, cut into ``max_seq_len`` chunks; nothing (counted) for a bad record."""
        text = record_text(record, self.formats[spec.name], spec.text_key)
        if text is None:
            count_bad(stats, _record_origin(record, spec), self.max_bad_fraction)
            return iter(())
        if not text:
            return iter(())
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return chunk_document(ids, self.cfg.max_seq_len, first_offset)

    def _cost(self, item: Any) -> int:
        """What an item counts against ``tokens_per_micro_batch``."""
        return len(item)

    def _pack(self, items: list[Any]) -> dict:
        """One micro-batch dict from the items packed into it."""
        return pack_samples(items)

    # ----- the shared reader: streams, mixture, positions, packing ---------------------------
    def _streams(self, consumer: int, consumers: int) -> list[SourceStream]:
        train = self.split == "train"
        return [
            SourceStream(spec.name, files, lambda record, offset, stats, spec=spec: self._items(record, spec, offset,
                                                                                                 stats),
                         consumer, consumers, self.seed, train, self.cfg.shuffle,
                         self.cfg.shuffle_window if train else 1, self.max_bad_fraction,
                         dict(self._plans.get(spec.name, {})))
            for spec, files in zip(self.specs, self.files)
        ]

    def _samples(self, start: Position) -> Iterator[tuple[Drawn, Position, Position]]:
        """This consumer's samples from ``start`` on, mixed by weight, each with the positions before
        and after it."""
        streams = self._live = self._streams(*self.consumer())
        iters = [stream.items(pos) for stream, pos in zip(streams, start.sources)]
        positions, counts = list(start.sources), list(start.counts)
        peeked: list[tuple[Any, StreamPosition, Ref] | None] = [None] * len(streams)

        def pull(index: int) -> None:
            peeked[index] = next(iters[index], None)
            positions[index] = peeked[index][1] if peeked[index] is not None else streams[index].end

        live = [weight > 0 for weight in self.weights]
        for index in range(len(streams)):
            if live[index]:
                pull(index)
        while True:
            index = next_source([w if live[i] and peeked[i] is not None else 0.0 for i, w in enumerate(self.weights)],
                                counts)
            if index < 0:
                break
            item, _, ref = peeked[index]
            before = Position(tuple(positions), tuple(counts))
            counts[index] += 1
            pull(index)
            yield Drawn(item, ref, index), before, Position(tuple(positions), tuple(counts))
        self._end = Position(tuple(positions), tuple(counts))

    def __iter__(self) -> Iterator[Any]:
        """Start at the loaded position (once), else at the beginning; eval is one pass, train loops.
        Yields packed micro-batches, or single ``Drawn`` samples when ``unpacked`` (a balancing feed
        packs them after reordering, see ``veomni/data/group_reorder.py``)."""
        start = self.begin()
        if self._merged is not None:
            start, self._merged = self._merged_start(self._merged), None
            self._pos = start
        return self._drawn(start) if self.unpacked else self._batches(start)

    def _drawn(self, start: Position) -> Iterator[Drawn]:
        for drawn, _, after in self._samples(start):
            self._pos = after
            yield drawn

    def _batches(self, start: Position) -> Iterator[dict]:
        tagged = ((drawn, before) for drawn, before, _ in self._samples(start))
        for drawn, next_position in greedy_pack(tagged, self.cfg.tokens_per_micro_batch,
                                                cost=lambda d: self._cost(d.item)):
            self._pos = next_position if next_position is not None else self._end
            yield self.pack_drawn(drawn)

    def pack_drawn(self, drawn: list[Drawn]) -> dict:
        """One micro-batch of drawn samples; a training one says how many came from each source."""
        batch = self._pack([d.item for d in drawn])
        if self.split == "train":
            batch[SOURCE_COUNTS] = {spec.name: sum(d.source == i for d in drawn) for i, spec in enumerate(self.specs)}
            if self.run_counts_bad:
                batch[READ_COUNTS] = self.read_counts()
        return batch

    def units(self, drawn: Drawn) -> int:
        """What a drawn sample counts against ``tokens_per_micro_batch``."""
        return self._cost(drawn.item)

    def drawn_at(self, ref: Ref) -> Drawn:
        """A sample read again on its own from its ref (a balancing window restored at a resume)."""
        index = [spec.name for spec in self.specs].index(ref.source)
        stream = self._streams(*self.consumer())[index]
        return Drawn(stream.item_at(ref), ref, index)

    # ----- state -------------------------------------------------------------------------------
    def _files_signature(self) -> dict[str, list[int]]:
        return {spec.name: [len(files.files), sum(files.sizes)] for spec, files in zip(self.specs, self.files)}

    def position_state(self) -> dict[str, Any]:
        return {
            "sources": {spec.name: asdict(pos) for spec, pos in zip(self.specs, self._pos.sources)},
            "counts": {spec.name: n for spec, n in zip(self.specs, self._pos.counts)},
            "weights": {spec.name: w for spec, w in zip(self.specs, self.weights)},
            "files": self._files_signature(),
            "plans": {name: plans_to_rows(plans) for name, plans in self._plans.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self._check_sources(state)
        self._plans = {name: plans_from_rows(rows) for name, rows in state["plans"].items()}
        self.resume_at(self.position_from(state))

    def position_from(self, state: dict[str, Any]) -> Position:
        positions = tuple(StreamPosition(**state["sources"][spec.name]) if spec.name in state["sources"]
                          else StreamPosition() for spec in self.specs)
        return Position(positions, self._resumed_counts(state))

    def _check_sources(self, state: dict[str, Any]) -> None:
        """Refuse a state whose sources' files changed (its offsets would point at other records)."""
        for name, signature in self._files_signature().items():
            saved = state["files"].get(name)
            if saved is not None and list(saved) != signature:
                raise BadData(
                    f"data source {name!r} changed since the checkpoint ({saved[0]} files, {saved[1]} bytes then; "
                    f"{signature[0]} files, {signature[1]} bytes now): its saved position would point at other "
                    "records. Restore the files, or give the changed data a new source name"
                )
        dropped = sorted(set(state["sources"]) - {spec.name for spec in self.specs})
        if dropped:
            logger.warning("data sources %s of the checkpoint are not in this run; their positions are dropped",
                           dropped)

    def _resumed_counts(self, state: dict[str, Any]) -> tuple[int, ...]:
        """The mixture's counts, or zeros when the weights changed (new weights act from the next sample)."""
        saved = state.get("weights", {})
        if saved != {spec.name: w for spec, w in zip(self.specs, self.weights)}:
            if self.split == "train" and len(self.specs) > 1:
                logger.info("data source weights changed at resume (%s -> %s): the mixture follows the new "
                            "weights from the next sample", saved, dict(zip([s.name for s in self.specs],
                                                                            self.weights)))
            return tuple(0 for _ in self.specs)
        return tuple(state["counts"].get(spec.name, 0) for spec in self.specs)

    @classmethod
    def merge_positions(cls, states: list[dict[str, Any]]) -> dict[str, Any]:
        """Every old consumer's state, once each: the new consumers share out what they had not read."""
        return {"format": STATE_FORMAT, "states": every_consumer(states)}

    def start_from(self, merged: dict[str, Any]) -> None:
        """Begin the next iteration with this consumer's share of what an old layout left (resolved in
        the consumer itself: a loader worker knows its index only there)."""
        for state in merged["states"]:
            check_format(state, STATE_FORMAT)
            self._check_sources(state)
        self._merged = list(merged["states"])

    def _merged_start(self, old_states: list[dict[str, Any]]) -> Position:
        consumer, consumers = self.consumer()
        positions = []
        for stream in self._streams(consumer, consumers):
            position, self._plans[stream.name] = new_plans(stream, old_states, consumer, consumers)
            positions.append(position)
        return Position(tuple(positions), tuple(0 for _ in self.specs))


def _record_origin(record: Any, spec: SourceSpec) -> str:
    return record.get("__url__", spec.path) if isinstance(record, dict) else spec.path


def merge_loader_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Turn the per-rank loader states of an old run (any dp size / workers) into one state any new
    layout loads with ``loader.load_state_dict(merged)``: exact, see ``veomni/data/relayout.py``. Pass
    the states of *all* old ranks. The mixture's counts restart."""
    return PackedTextDataset.merge_states(states)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Load a tokenizer folder offline; fail clearly when it is missing or has no eos token."""
    folder = Path(path)
    if (
        not path
        or not (folder / "tokenizer.json").is_file()
        and not (folder / "tokenizer_config.json").is_file()
    ):
        raise MissingInput(f"tokenizer folder {path!r} not found (expected tokenizer.json inside)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tokenizer.eos_token_id is None:
        raise BadData(f"tokenizer {path!r} defines no eos_token")
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
    """A text dataset's sources are readable and hold records, and its tokenizer fits the model's
    vocabulary (that its samples fit its micro-batches is the plan's check, ``check_sample_length``)."""
    return check_sources(cfg) + _check_tokenizer(cfg, model_config)


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
    return PackedTextDataset(r.cfg, r.split, r.tokenizer, r.dp_rank, r.dp_size, r.seed)


register_dataset(DatasetKind("packed_text", _build_packed_text, needs_tokenizer=True, check=check_text_data,
                             check_plan=check_sample_length,
                             balances=True))
