"""Document readers: text records from webdataset tar shards or jsonl files.

A corpus is a list of files (tar shards or jsonl files). Reading yields the good documents'
text in file order; a bad record (missing text key, undecodable bytes, broken JSON line) or a
corrupt/truncated shard is skipped, counted and logged, so one damaged file does not stop a long
run. Only when the skipped fraction of a pass exceeds ``max_bad_fraction`` does reading raise
:class:`BadDataError`, because then the data itself is wrong and training on it would be silent
garbage.

How much a damaged shard lost: a builder's ``manifest.json`` lists the records of each shard
(``shard_records``, ``veomni.data.builders.publish_split``), so a shard that yields fewer counts
every missing record as bad, whether it broke off mid-record or ends cleanly at a record
boundary; a large shard cut short then trips ``max_bad_fraction``. Shards without such a count
(the user's own, older builds) count a damaged file as one bad record, as nothing says more.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from webdataset.tariterators import base_plus_ext, group_by_keys, tar_file_iterator

from veomni.data.builders import MANIFEST
from veomni.errors import BadConfig, BadData, BadInput, MissingInput

logger = logging.getLogger(__name__)

FORMATS = ("webdataset", "jsonl")
T = TypeVar("T")
MIN_RECORDS_FOR_EARLY_CHECK = 1000
"""The bad fraction is checked after each file once this many records were read (a few bad
records among the first dozen say little), and always at the end of a pass."""


class BadDataError(BadInput, RuntimeError):
    """Too large a fraction of the records could not be read."""


class InvalidSampleError(BadData):
    """A record that reads fine but contradicts itself (e.g. more media placeholders than media):
    a bug in the data's producer that skipping would hide, so it stops the run, naming the sample."""


@dataclass
class ReadStats:
    """Counts of one pass over the files; ``records`` includes the bad ones."""

    records: int = 0
    bad: int = 0
    bad_by_file: Counter = field(default_factory=Counter)


def resolve_files(path: str, fmt: str = "auto") -> tuple[str, list[Path]]:
    """Return ``(format, sorted files)`` for a folder of ``*.tar`` / ``*.jsonl`` or a single file.

    ``auto`` picks webdataset when the path holds tar shards, else jsonl. Raises
    ``FileNotFoundError`` naming the path when it is missing or holds no data files.
    """
    if fmt not in ("auto", *FORMATS):
        raise BadConfig(f"unknown data format {fmt!r}; expected auto, webdataset or jsonl")
    root = Path(path)
    if not path or not root.exists():
        raise MissingInput(f"data path {path!r} does not exist")
    suffix_of = {"webdataset": ".tar", "jsonl": ".jsonl"}
    if root.is_file():
        found = {name: [root] for name, suffix in suffix_of.items() if root.suffix == suffix}
    else:
        found = {name: sorted(root.glob(f"*{suffix}")) for name, suffix in suffix_of.items()}
    candidates = list(FORMATS) if fmt == "auto" else [fmt]
    for name in candidates:
        if found.get(name):
            return name, found[name]
    wanted = " or ".join(suffix_of[name] for name in candidates)
    raise MissingInput(f"data path {path!r} holds no {wanted} files")


def manifest_shard_records(path: str | Path) -> dict[str, int]:
    """Records per shard file name as the builder manifest of the folder ``path`` lists them
    (``shard_records``); empty where there is none (a single file, the user's own shards, a build
    older than the count), so damage there counts as one bad record (module docstring)."""
    file = Path(path) / MANIFEST
    if not file.is_file():
        return {}
    try:
        counts = json.loads(file.read_text()).get("shard_records", {})
        return {str(name): int(count) for name, count in counts.items()}
    except (OSError, ValueError, AttributeError, TypeError) as error:
        raise BadData(f"{file} cannot be read as a builder manifest with shard_records {{\"shard file\": "
                      f"records}} ({error}); rebuild the split with its builder (data/build_*.py) or fix "
                      "or remove the manifest") from None


def count_shard_end(stats: ReadStats, file: Path, read: int, expected: int | None,
                    damage: Exception | None, log: Callable[..., None] = logger.warning) -> int:
    """Count what ``file`` lost once read to its end or to ``damage``, having yielded ``read``
    records: the records its manifest lists (``expected``) beyond those, raised or not, else one
    bad record for damage (how many it held is unknown). Returns the records counted lost."""
    missing = expected - read if expected is not None else 0
    lost = max(missing, 1 if damage is not None else 0)
    if lost:
        stats.records += lost
        stats.bad += lost
        stats.bad_by_file[str(file)] += lost
        cause = f"{type(damage).__name__}: {damage}" if damage is not None else "it ends at a record boundary"
        listed = f" of the {expected} its manifest lists" if expected is not None else ""
        log("%s: read %d record(s)%s, counting %d lost as bad (%s); rebuild or re-copy the shard",
            file, read, listed, lost, cause)
    return lost


def tar_samples(file: Path) -> Iterator[dict]:
    """Samples of one tar shard, grouped by key with webdataset's own tar iteration."""
    with open(file, "rb") as stream:
        members = ({**member, "__url__": str(file)} for member in tar_file_iterator(stream))
        yield from group_by_keys(members, keys=base_plus_ext)


def record_text(record: Any, fmt: str, text_key: str) -> str | None:
    """The text of one record (a webdataset sample dict, or a jsonl line's bytes); ``None`` for a bad
    record: the key missing, bytes that are not utf-8, a line that is not a JSON object of a string."""
    if fmt == "webdataset":
        raw = record.get(text_key)
        if raw is None:
            logger.debug("%s: sample %s has no %r member", record.get("__url__"), record.get("__key__"), text_key)
            return None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            logger.debug("%s: sample %s is not utf-8", record.get("__url__"), record.get("__key__"))
            return None
    try:
        text = json.loads(record.decode("utf-8"))[text_key]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        logger.debug("bad jsonl record %r", record[:80])
        return None
    return text if isinstance(text, str) else None


def _tar_texts(file: Path, text_key: str) -> Iterator[str | None]:
    """Text of each sample; ``None`` for a bad record."""
    for sample in tar_samples(file):
        yield record_text(sample, "webdataset", text_key)


def _jsonl_texts(file: Path, text_key: str) -> Iterator[str | None]:
    """Text of each non-blank line; ``None`` for a bad record."""
    with open(file, "rb") as stream:
        for line in stream:
            if line.strip():
                yield record_text(line, "jsonl", text_key)


def check_bad_fraction(stats: ReadStats, max_bad_fraction: float, file: Path, end_of_pass: bool) -> None:
    if not stats.records or (not end_of_pass and stats.records < MIN_RECORDS_FOR_EARLY_CHECK):
        return
    if stats.bad / stats.records > max_bad_fraction:
        worst, worst_count = stats.bad_by_file.most_common(1)[0]
        raise BadDataError(
            f"{stats.bad} of {stats.records} records were bad ({stats.bad / stats.records:.1%} > "
            f"max_bad_fraction {max_bad_fraction:.1%}); worst file {worst} ({worst_count} bad), "
            f"last file read {file}"
        )


def iter_texts(
    files: list[Path],
    fmt: str,
    text_key: str,
    max_bad_fraction: float,
    stats: ReadStats,
    warn: bool = True,
    shard_records: Mapping[str, int] | None = None,
) -> Iterator[str]:
    """Yield the non-empty text of every good record of ``files`` in order, counting into ``stats``.

    A file that cannot be opened or ends mid-record counts as one bad record, or as the records it
    lost given ``shard_records`` (:func:`count_shard_end`); the records read before the damage are
    kept. ``warn=False`` logs skips at debug level (every data-parallel
    consumer reads the same files, so only one of them needs to warn).
    """
    read_file = _tar_texts if fmt == "webdataset" else _jsonl_texts
    texts = iter_records(files, lambda file: read_file(file, text_key), max_bad_fraction, stats, warn, shard_records)
    return (text for text in texts if text)


def iter_tar_samples(files: list[Path], max_bad_fraction: float, stats: ReadStats,
                     warn: bool = True, shard_records: Mapping[str, int] | None = None) -> Iterator[dict]:
    """Every sample dict (``__key__``, ``__url__`` and one bytes value per member suffix) of
    webdataset ``files`` in order; damaged shards are handled as in :func:`iter_texts`."""
    return iter_records(files, tar_samples, max_bad_fraction, stats, warn, shard_records)


def count_bad(stats: ReadStats, file: str | Path, max_bad_fraction: float) -> None:
    """Count one record the caller found bad after reading it (e.g. an image that does not
    decode), and stop once the pass's bad fraction is over ``max_bad_fraction``."""
    stats.bad += 1
    stats.bad_by_file[str(file)] += 1
    check_bad_fraction(stats, max_bad_fraction, Path(file), end_of_pass=False)


def iter_records(
    files: list[Path],
    read_file: Callable[[Path], Iterator[T | None]],
    max_bad_fraction: float,
    stats: ReadStats,
    warn: bool = True,
    shard_records: Mapping[str, int] | None = None,
) -> Iterator[T]:
    """Every good record ``read_file`` yields for ``files`` (``None`` marks a bad one), counting
    into ``stats``; a file that raises while being read, or yields fewer records than
    ``shard_records`` (by file name, from the manifest) lists, counts as :func:`count_shard_end` says."""
    log = logger.warning if warn else logger.debug
    expected = shard_records or {}
    for file in files:
        bad_before, records_before = stats.bad, stats.records
        damage: Exception | None = None
        try:
            for record in read_file(file):
                stats.records += 1
                if record is None:
                    stats.bad += 1
                    stats.bad_by_file[str(file)] += 1
                else:
                    yield record
        except Exception as error:  # noqa: BLE001 - any damage in one file must not stop the run
            damage = error
        count_shard_end(stats, file, stats.records - records_before, expected.get(file.name), damage, log)
        if stats.bad > bad_before:
            log(
                "%s: skipped %d bad record(s); %d of %d bad so far in this pass",
                file,
                stats.bad - bad_before,
                stats.bad,
                stats.records,
            )
        check_bad_fraction(stats, max_bad_fraction, file, end_of_pass=file == files[-1])
