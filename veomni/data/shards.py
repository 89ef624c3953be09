"""Shard byte layer: which bytes of which files hold which records, read by seeking.

The data loader gives every consumer (data-parallel rank x loader worker) its own files or byte
ranges instead of letting each consumer read every record and keep every C-th, so an epoch reads
the corpus once whatever the number of consumers, and a saved position resumes by a seek instead
of a re-read. This module knows files, byte ranges and records only; tokens, shuffles and loader
state live above it.

A :class:`Piece` owns the records whose first byte lies in its range, so a cut may fall inside a
record (the Hadoop rule for text): the piece where a record starts reads it whole, the next piece
skips to the first record starting at or after its own start. For jsonl that is the line after the
first newline; a tar header cannot be recognised from the middle of a file, so tar shards keep a
per-file index of sample starts, found by walking the header blocks from the file's start.
"""

from __future__ import annotations

import re
import tarfile
from bisect import bisect_left
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from webdataset.tariterators import base_plus_ext

from veomni.errors import BadData

FORMATS = ("jsonl", "webdataset")
BLOCK = tarfile.BLOCKSIZE
EXTENSION_TYPES = (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
"""Header types that describe the member whose header follows them (a pax global header is not one:
tarfile treats it as a member of its own, and so does this reader)."""
SKIPPED_META = re.compile(r"__[^/]*__($|/)")
"""Member names webdataset's ``tar_file_iterator`` skips by default."""
PAX_RECORD = re.compile(rb"(\d+) ([^=]+)=")
DRAIN_CHUNK = 1 << 20


@dataclass(frozen=True)
class Piece:
    """The records of file ``file`` (an index into the file list) whose first byte lies in [start, end).
    ``aligned``: ``start`` is known to be a record's first byte (a file's start or a saved position),
    so reading starts there without searching."""

    file: int
    start: int
    end: int
    aligned: bool = True


@dataclass(frozen=True)
class _Member:
    """One tar member: ``offset`` is its first header block (extension headers included), its data
    (``data_size`` bytes, then padding to a block) starts at ``data_offset``."""

    offset: int
    data_offset: int
    data_size: int
    name: str
    regular: bool

    @property
    def next_offset(self) -> int:
        return self.data_offset + _padded(self.data_size)


@dataclass
class _SampleStarts:
    """The sample starts of one tar file found so far, and where the header walk goes on."""

    offsets: list[int] = field(default_factory=list)
    next_header: int = 0
    last_key: str | None = None
    complete: bool = False


class _CountingFile:
    """A binary file whose reads add to ``owner.bytes_read``; seeks cost nothing."""

    def __init__(self, raw: BinaryIO, owner: ShardFiles) -> None:
        self._raw = raw
        self._owner = owner

    def read(self, size: int = -1) -> bytes:
        return self._count(self._raw.read(size))

    def readline(self) -> bytes:
        return self._count(self._raw.readline())

    def seek(self, offset: int) -> None:
        self._raw.seek(offset)

    def _count(self, data: bytes) -> bytes:
        self._owner.bytes_read += len(data)
        return data


class ShardFiles:
    """The files of one corpus, read piece by piece; ``bytes_read`` counts every byte read from them.
    ``shard_records``: records per file name as the folder's manifest lists them (what a damaged
    shard lost, ``veomni.data.sources.count_shard_end``); empty when unknown."""

    def __init__(self, files: list[Path], fmt: str, shard_records: dict[str, int] | None = None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown shard format {fmt!r}; expected one of {FORMATS}")
        self.files = list(files)
        self.fmt = fmt
        self.shard_records = shard_records or {}
        self.sizes = [file.stat().st_size for file in self.files]
        self.bytes_read = 0
        self._sample_starts: dict[int, _SampleStarts] = {}

    def records(self, piece: Piece) -> Iterator[tuple[int, Any]]:
        """(offset, record) for each record whose first byte is in [piece.start, piece.end), in file order.
        jsonl: record = the line's bytes without the trailing newline; blank lines are skipped (not yielded).
        webdataset: record = dict {"__key__": key, "__url__": str(path), "<suffix>": bytes, ...} exactly like
        webdataset's group_by_keys output, offset = the offset of the sample's first member's first header block
        (including any pax/gnu extended header that precedes it).
        A record that starts before ``end`` is read whole even when it extends past ``end``.
        Damage (truncated or corrupt tar, a file that vanished) raises after yielding the records read before it;
        the caller counts the damage."""
        if piece.start < piece.end:
            yield from (self._jsonl_records if self.fmt == "jsonl" else self._tar_records)(piece)

    def expected_records(self, piece: Piece) -> int | None:
        """The records ``piece`` should yield per the manifest: known only for a whole file."""
        if piece.start != 0 or piece.end < self.sizes[piece.file]:
            return None
        return self.shard_records.get(self.files[piece.file].name)

    def record_at(self, file: int, offset: int) -> Any:
        """The one record starting at ``offset`` (a value ``records`` yielded), read by seeking."""
        with closing(self.records(Piece(file, offset, offset + 1))) as found:
            for _, record in found:
                return record
        raise LookupError(f"{self.files[file]}: no record starts at byte {offset}")

    @contextmanager
    def _open(self, file: int) -> Iterator[_CountingFile]:
        with open(self.files[file], "rb") as raw:
            yield _CountingFile(raw, self)

    def _jsonl_records(self, piece: Piece) -> Iterator[tuple[int, bytes]]:
        with self._open(piece.file) as stream:
            position = piece.start
            if piece.aligned or position == 0:
                stream.seek(position)
            else:
                stream.seek(position - 1)
                position += len(stream.readline()) - 1
            while position < piece.end:
                line = stream.readline()
                if not line:
                    return
                if line.strip():
                    yield position, line.removesuffix(b"\n")
                position += len(line)

    def _tar_records(self, piece: Piece) -> Iterator[tuple[int, dict]]:
        start = piece.start if piece.aligned else self._first_sample_at_or_after(piece.file, piece.start)
        if start is None or start >= piece.end:
            return
        url = str(self.files[piece.file])
        with self._open(piece.file) as stream:
            stream.seek(start)
            offset, sample_offset, sample = start, start, None
            while (member := _read_member(stream, offset)) is not None:
                named = _key_and_suffix(member)
                if named is not None and (sample is None or named[0] != sample["__key__"]):
                    if sample is not None:
                        yield sample_offset, sample
                    if member.offset >= piece.end:
                        return
                    sample_offset, sample = member.offset, {"__key__": named[0], "__url__": url}
                data = _read_exact(stream, _padded(member.data_size), member.data_offset)[: member.data_size]
                offset = member.next_offset
                if named is not None:
                    if named[1] in sample:
                        raise BadData(f"{url}: duplicate file name {member.name!r} in sample {named[0]!r}")
                    sample[named[1]] = data
            while stream.read(DRAIN_CHUNK):  # end-of-archive blocks and padding: a whole file reads its size
                pass
            if sample is not None:
                yield sample_offset, sample

    def _first_sample_at_or_after(self, file: int, position: int) -> int | None:
        starts = self._sample_starts.setdefault(file, _SampleStarts())
        if not starts.complete and (not starts.offsets or starts.offsets[-1] < position):
            self._walk_headers(file, starts, position)
        index = bisect_left(starts.offsets, position)
        return starts.offsets[index] if index < len(starts.offsets) else None

    def _walk_headers(self, file: int, starts: _SampleStarts, position: int) -> None:
        """Extend ``starts`` until it holds a sample start at or after ``position`` or the archive ends,
        reading only header and extension blocks. Damage ends the walk quietly: the piece that reads
        the sample before it raises."""
        with self._open(file) as stream:
            while not starts.complete and (not starts.offsets or starts.offsets[-1] < position):
                stream.seek(starts.next_header)
                try:
                    member = _read_member(stream, starts.next_header)
                except (tarfile.TarError, ValueError):
                    member = None
                if member is None:
                    starts.complete = True
                    return
                starts.next_header = member.next_offset
                named = _key_and_suffix(member)
                if named is not None and named[0] != starts.last_key:
                    starts.offsets.append(member.offset)
                    starts.last_key = named[0]


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _read_exact(stream: _CountingFile, size: int, offset: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise tarfile.ReadError(f"tar ends inside the member data at byte {offset}")
    return data


def _pax_records(data: bytes) -> dict[str, str]:
    """The ``"<length> <key>=<value>\\n"`` records of a pax extended header, decoded as tarfile does."""
    records = {}
    position = 0
    while match := PAX_RECORD.match(data, position):
        length = int(match.group(1))
        if length == 0:
            raise tarfile.ReadError("pax record of length 0")
        value = data[match.end() : position + length - 1]
        records[match.group(2).decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        position += length
    return records


def _read_member(stream: _CountingFile, offset: int) -> _Member | None:
    """The member whose header starts at ``offset``, where ``stream`` stands; ``None`` at the
    end-of-archive block. A file that ends at or inside a header is truncated, so it raises."""
    position, extended, long_name = offset, {}, None
    while True:
        block = stream.read(BLOCK)
        if not block:
            raise tarfile.ReadError(f"tar ends at byte {position} without an end-of-archive block")
        try:
            info = tarfile.TarInfo.frombuf(block, tarfile.ENCODING, "surrogateescape")
        except tarfile.EOFHeaderError:
            return None
        except tarfile.HeaderError as error:
            raise tarfile.ReadError(f"bad tar header at byte {position}: {error}") from error
        position += BLOCK
        if info.type not in EXTENSION_TYPES:
            break
        data = _read_exact(stream, _padded(info.size), position)[: info.size]
        position += _padded(info.size)
        if info.type == tarfile.GNUTYPE_LONGNAME:
            long_name = data.split(b"\0", 1)[0].decode(tarfile.ENCODING, "surrogateescape")
        elif info.type != tarfile.GNUTYPE_LONGLINK:
            extended.update(_pax_records(data))
    if info.type == tarfile.GNUTYPE_SPARSE:
        raise tarfile.ReadError(f"GNU sparse member at byte {offset} is not supported")
    regular = info.type in tarfile.REGULAR_TYPES
    size = int(extended.get("size", info.size)) if regular or info.type not in tarfile.SUPPORTED_TYPES else 0
    return _Member(offset, position, size, extended.get("path", long_name or info.name), regular)


def _key_and_suffix(member: _Member) -> tuple[str, str] | None:
    """The sample key and (lower-case) suffix webdataset gives ``member``; ``None`` for a member its
    reader skips: not a regular file, metadata, or a name without an extension."""
    if not member.regular or SKIPPED_META.match(member.name):
        return None
    key, suffix = base_plus_ext(member.name)
    return None if key is None else (key, suffix.lower())


def epoch_pieces(sizes: list[int], order: list[int], consumers: int) -> list[list[Piece]]:
    """Every consumer's pieces for one epoch, given the epoch's file order. With at least as many files
    as consumers: whole files, each file in ``order`` going to the consumer with the fewest bytes so far
    (ties: lowest consumer index), keeping ``order`` within each consumer. With fewer files than consumers:
    ``split_pieces`` of the whole files in ``order``. Every byte of every file is in exactly one piece."""
    if len(order) < consumers:
        return split_pieces([Piece(file, 0, sizes[file]) for file in order], consumers)
    pieces: list[list[Piece]] = [[] for _ in range(consumers)]
    loads = [0] * consumers
    for file in order:
        lightest = loads.index(min(loads))
        pieces[lightest].append(Piece(file, 0, sizes[file]))
        loads[lightest] += sizes[file]
    return pieces


def split_pieces(pieces: list[Piece], parts: int) -> list[list[Piece]]:
    """Cut a sequence of pieces into ``parts`` contiguous runs of (as near as possible) equal bytes
    (``end - start``), cutting a piece where a boundary falls inside it: the head keeps its ``aligned``,
    the tail is ``aligned=False``. Zero-length pieces may be dropped. A piece of length 1 (one record
    referenced by its exact offset, end = start + 1) is never cut.

    Run ``k`` ends at byte ``total * (k + 1) // parts`` of the sequence, so runs differ by at most one
    byte, and an integer boundary cannot fall strictly inside a length-1 piece."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    total = sum(piece.end - piece.start for piece in pieces)
    run_ends = [total * (run + 1) // parts for run in range(parts)]
    runs: list[list[Piece]] = [[] for _ in range(parts)]
    run, done = 0, 0
    for piece in pieces:
        start, aligned = piece.start, piece.aligned
        while start < piece.end:
            while run_ends[run] <= done:
                run += 1
            taken = min(piece.end - start, run_ends[run] - done)
            runs[run].append(Piece(piece.file, start, start + taken, aligned))
            start, done, aligned = start + taken, done + taken, False
    return runs
