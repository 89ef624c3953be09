"""Shard byte layer: consumers' pieces cover every record exactly once, reading the corpus about once.

References are independent of the module under test: jsonl lines found by splitting the whole file,
tar samples from webdataset's own reader (``tar_file_iterator`` + ``group_by_keys``) and member
offsets from :mod:`tarfile`.
"""

from __future__ import annotations

import io
import json
import random
import tarfile
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import pytest
import webdataset
from webdataset.tariterators import base_plus_ext, group_by_keys, tar_file_iterator

from veomni.data.shards import Piece, ShardFiles, epoch_pieces, split_pieces

FILE_COUNTS = (1, 3, 8)
TAR_FORMATS = (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT)


def write_jsonl(path: Path, rng: random.Random, lines: int) -> None:
    """Lines of 2 to ~6000 bytes, blank and whitespace-only lines among them; some files lack the final newline."""
    rows = []
    for index in range(lines):
        if rng.random() < 0.15:
            rows.append(rng.choice(["", "   ", "\t"]))
        rows.append(json.dumps({"id": index, "text": "x" * rng.choice([0, 1, 7, 300, 2000, 6000])}))
    path.write_text("\n".join(rows) + rng.choice(["\n", ""]))


def tar_sample(rng: random.Random, index: int, prefix: str, long_keys: bool = True) -> dict:
    """Three to four members of odd sizes; with ``long_keys`` every fourth key is long enough to need a
    pax or GNU long-name header."""
    key = f"{prefix}{'k' * 110 if long_keys and index % 4 == 0 else ''}{index:05d}"
    sample = {
        "__key__": key,
        "txt": f"text of {key}".encode(),
        "bin": rng.randbytes(rng.choice([0, 1, 511, 512, 513, 2049, 5000, 9001])),
        "0.png": rng.randbytes(rng.randint(1, 4000)),
    }
    if index % 3 == 0:
        sample["CLS"] = b"%d" % index
    return sample


def add_member(tar: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, len(data)
    tar.addfile(info, io.BytesIO(data))


def write_tar(path: Path, rng: random.Random, samples: int, tar_format: int) -> None:
    """Pax shards come from webdataset's TarWriter (which writes pax whatever its ``format`` argument says);
    GNU and ustar ones from tarfile, the ustar ones with paths long enough to need its prefix field."""
    if tar_format == tarfile.PAX_FORMAT:
        with webdataset.TarWriter(str(path), encoder=False, mtime=0) as writer:
            for index in range(samples):
                writer.write(tar_sample(rng, index, "s"))
        return
    ustar = tar_format == tarfile.USTAR_FORMAT
    prefix = "dir_" + "d" * 120 + "/" if ustar else "g"
    with tarfile.open(path, "w", format=tar_format) as tar:
        for index in range(samples):
            sample = tar_sample(rng, index, prefix, long_keys=not ustar)
            key = sample.pop("__key__")
            for suffix, data in sample.items():
                add_member(tar, f"{key}.{suffix}", data)


def write_tar_with_extras(path: Path, rng: random.Random) -> None:
    """Members webdataset's reader skips (a pax global header, a directory, metadata, a symlink, a name
    without an extension) before, between and inside samples, and two one-member samples in a row."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "made by a test"}) as tar:
        add_member(tar, "images", kind=tarfile.DIRTYPE)
        add_member(tar, "__index__", b"meta")
        add_member(tar, "__meta__/info.json", b"{}")
        add_member(tar, "solo1.txt", b"one")
        add_member(tar, "solo2.json", b"two")
        for index in range(6):
            sample = tar_sample(rng, index, "e")
            key = sample.pop("__key__")
            for position, (suffix, data) in enumerate(sample.items()):
                add_member(tar, f"{key}.{suffix}", data)
                if index == 2 and position == 0:
                    add_member(tar, "README", b"no extension")
                    add_member(tar, "link.txt", kind=tarfile.SYMTYPE)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, list[Path]]:
    """Eight files per format in a shuffled order, the second one zero bytes long (so the one-file corpus has
    records and the others hold an empty file)."""
    folder = tmp_path_factory.mktemp("shards")
    rng = random.Random(0)
    jsonl = [folder / f"part{index}.jsonl" for index in range(8)]
    for index, path in enumerate(jsonl):
        write_jsonl(path, rng, lines=0 if index == 5 else rng.randint(5, 60))
    tars = [folder / f"shard{index}.tar" for index in range(8)]
    for index, path in enumerate(tars[:6]):
        write_tar(path, rng, rng.randint(3, 25), TAR_FORMATS[index % len(TAR_FORMATS)])
    write_tar_with_extras(tars[6], rng)
    tars[7].write_bytes(b"")
    corpora = {"jsonl": jsonl, "webdataset": tars}
    for files in corpora.values():
        rng.shuffle(files)
        files.insert(1, files.pop(next(index for index, path in enumerate(files) if path.stat().st_size == 0)))
    return corpora


def jsonl_reference(path: Path) -> list[tuple[int, bytes]]:
    records, position = [], 0
    for line in path.read_bytes().split(b"\n"):
        if line.strip():
            records.append((position, line))
        position += len(line) + 1
    return records


def webdataset_samples(path: Path) -> list[dict]:
    if path.stat().st_size == 0:
        return []
    with open(path, "rb") as stream:
        members = ({**member, "__url__": str(path)} for member in tar_file_iterator(stream))
        return list(group_by_keys(members, keys=base_plus_ext))


def member_names_by_offset(path: Path) -> dict[int, str]:
    """tarfile's header offset (TarInfo.offset, extension headers included) of every member."""
    if path.stat().st_size == 0:
        return {}
    with tarfile.open(path) as tar:
        return {member.offset: member.name for member in tar.getmembers()}


def read_pieces(shards: ShardFiles, pieces: list[Piece]) -> list[tuple[int, int, object]]:
    return [(piece.file, offset, record) for piece in pieces for offset, record in shards.records(piece)]


def test_corpus_has_the_headers_the_tests_are_about(corpora):
    """The tar corpus holds pax, GNU long-name, ustar-prefix and pax global headers, and odd member sizes."""
    header_types, names, sizes = Counter(), [], set()
    for path in corpora["webdataset"]:
        data = path.read_bytes()
        header_types[data[156:157]] += 1
        for offset, name in member_names_by_offset(path).items():
            header_types[data[offset + 156 : offset + 157]] += 1
            names.append(name)
        sizes.update(len(value) % 512 for sample in webdataset_samples(path) for value in sample.values())
    assert header_types[tarfile.XHDTYPE] and header_types[tarfile.GNUTYPE_LONGNAME] and header_types[tarfile.XGLTYPE]
    assert any(len(name) > 100 and "/" in name for name in names)
    assert len(sizes) > 10


@pytest.mark.parametrize("fmt", ["jsonl", "webdataset"])
@pytest.mark.parametrize("file_count", FILE_COUNTS)
@pytest.mark.parametrize("consumers", range(1, 7))
def test_epoch_pieces_cover_every_record_once(corpora, fmt, file_count, consumers):
    files = corpora[fmt][:file_count]
    sizes = [path.stat().st_size for path in files]
    order = random.Random(consumers).sample(range(file_count), file_count)
    if fmt == "jsonl":
        expected = [(file, *record) for file, path in enumerate(files) for record in jsonl_reference(path)]
    else:
        expected = [(file, None, sample) for file, path in enumerate(files) for sample in webdataset_samples(path)]
    assert expected

    found, total_read = [], 0
    for pieces in epoch_pieces(sizes, order, consumers):
        shards = ShardFiles(files, fmt)
        records = read_pieces(shards, pieces)
        for before, after in zip(records, records[1:], strict=False):
            assert before[0] != after[0] or before[1] < after[1], "records of one file come in file order"
        found += records
        total_read += shards.bytes_read

    found.sort(key=lambda record: record[:2])
    if fmt == "webdataset":
        names = [member_names_by_offset(path) for path in files]
        for file, offset, sample in found:
            name = names[file][offset]
            assert base_plus_ext(name)[0] == sample["__key__"], "offset is the sample's first member header"
        found = [(file, None, sample) for file, _, sample in found]
    assert found == expected
    if file_count >= consumers:
        assert total_read == sum(sizes)
    else:
        assert sum(sizes) <= total_read <= sum(sizes) + max(sizes)


@pytest.mark.parametrize("fmt", ["jsonl", "webdataset"])
def test_record_at_round_trips(corpora, fmt):
    shards = ShardFiles(corpora[fmt], fmt)
    pairs = [(file, offset, record) for file, size in enumerate(shards.sizes) for offset, record in
             shards.records(Piece(file, 0, size))]
    assert len(pairs) > 50
    seeker = ShardFiles(corpora[fmt], fmt)
    for file, offset, record in pairs:
        assert seeker.record_at(file, offset) == record
    assert seeker.bytes_read < 2 * sum(shards.sizes), "each record_at reads about one record"


def test_record_at_reads_by_seeking(corpora):
    path = max(corpora["jsonl"], key=lambda path: path.stat().st_size)
    offset, line = jsonl_reference(path)[-1]
    shards = ShardFiles([path], "jsonl")
    assert shards.record_at(0, offset) == line
    assert shards.bytes_read in (len(line), len(line) + 1), "the line and its newline only"


@pytest.mark.parametrize("fmt", ["jsonl", "webdataset"])
def test_unaligned_piece_skips_the_record_it_starts_inside(corpora, fmt):
    path = max(corpora[fmt], key=lambda path: path.stat().st_size)
    shards = ShardFiles([path], fmt)
    size = shards.sizes[0]
    offsets = [offset for offset, _ in shards.records(Piece(0, 0, size))]
    for index, offset in enumerate(offsets[:-1]):
        inside = [found for found, _ in shards.records(Piece(0, offset + 1, size, aligned=False))]
        assert inside == offsets[index + 1 :]
        at_start = [found for found, _ in shards.records(Piece(0, offset, size, aligned=False))]
        assert at_start == offsets[index:]
        head = [found for found, _ in shards.records(Piece(0, 0, offset + 1))]
        assert head == offsets[: index + 1], "a record starting before the end is read whole"


def test_tar_piece_stops_at_the_next_sample_header(corpora):
    """A piece ending at the next sample reads that sample's header blocks (pax ones too), not its data."""
    path = next(path for path in corpora["webdataset"] if path.name == "shard0.tar")  # pax, long key at sample 0, 4
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    shards = ShardFiles([path], "webdataset")
    offsets = [offset for offset, _ in shards.records(Piece(0, 0, shards.sizes[0]))]
    for start, end in zip(offsets, offsets[1:], strict=False):
        shards.bytes_read = 0
        assert [offset for offset, _ in shards.records(Piece(0, start, end))] == [start]
        next_header = next(member for member in members if member.offset == end)
        assert shards.bytes_read == next_header.offset_data - start


@pytest.mark.parametrize("fmt", ["jsonl", "webdataset"])
def test_zero_byte_file_has_no_records(tmp_path, fmt):
    path = tmp_path / "empty"
    path.write_bytes(b"")
    shards = ShardFiles([path], fmt)
    assert list(shards.records(Piece(0, 0, 0))) == []
    assert [list(shards.records(piece)) for run in epoch_pieces([0], [0], 3) for piece in run] == []


def test_truncated_tar_yields_complete_samples_then_raises(corpora, tmp_path):
    """Cut anywhere: a sample is yielded once the next sample's header (or the end-of-archive block) was
    read whole, then reading raises; split over consumers, exactly one of them raises."""
    intact = next(path for path in corpora["webdataset"] if path.name == "shard0.tar")
    data = intact.read_bytes()
    samples = webdataset_samples(intact)
    with tarfile.open(intact) as tar:
        members = tar.getmembers()
    first_members = [next(member for member in members if base_plus_ext(member.name)[0] == sample["__key__"])
                     for sample in samples]
    archive_end = members[-1].offset_data + -(-members[-1].size // 512) * 512 + 512
    confirmed_at = [member.offset_data for member in first_members[1:]] + [archive_end]

    cut_path = tmp_path / "cut.tar"
    boundaries = {*range(1, archive_end + 600, 1009), *(m.offset for m in members), *(m.offset_data for m in members)}
    cuts = sorted(boundaries - {0})  # a zero-byte file is an empty shard, not a damaged one
    for cut in cuts:
        cut_path.write_bytes(data[:cut])
        expected = [sample for sample, needed in zip(samples, confirmed_at, strict=True) if needed <= cut]
        for sample in expected:
            sample["__url__"] = str(cut_path)
        damaged = cut < archive_end

        shards = ShardFiles([cut_path], "webdataset")
        got = []
        with pytest.raises(tarfile.ReadError) if damaged else nullcontext():
            got.extend(record for _, record in shards.records(Piece(0, 0, cut)))
        assert got == expected, cut

        if cut % 3 == 0:
            got, raised = [], 0
            for run in split_pieces([Piece(0, 0, cut)], 3):
                shards = ShardFiles([cut_path], "webdataset")
                try:
                    got.extend(record for piece in run for _, record in shards.records(piece))
                except tarfile.ReadError:
                    raised += 1
            assert (got, raised) == (expected, int(damaged)), cut


def test_vanished_file_raises(tmp_path):
    path = tmp_path / "gone.jsonl"
    path.write_text('{"a": 1}\n')
    shards = ShardFiles([path], "jsonl")
    path.unlink()
    with pytest.raises(FileNotFoundError):
        list(shards.records(Piece(0, 0, shards.sizes[0])))


def test_epoch_pieces_give_whole_files_to_the_lightest_consumer():
    sizes = [5, 3, 3, 1, 0, 4]
    assert epoch_pieces(sizes, [0, 1, 2, 3, 4, 5], 2) == [
        [Piece(0, 0, 5), Piece(3, 0, 1), Piece(4, 0, 0), Piece(5, 0, 4)],
        [Piece(1, 0, 3), Piece(2, 0, 3)],
    ]
    assert epoch_pieces([2, 2, 2], [2, 0, 1], 3) == [[Piece(2, 0, 2)], [Piece(0, 0, 2)], [Piece(1, 0, 2)]]
    assert epoch_pieces([10, 6], [1, 0], 4) == [
        [Piece(1, 0, 4)], [Piece(1, 4, 6, False), Piece(0, 0, 2)], [Piece(0, 2, 6, False)], [Piece(0, 6, 10, False)]
    ]


@pytest.mark.parametrize("seed", range(20))
def test_split_pieces_balances_bytes_and_keeps_single_records(seed):
    rng = random.Random(seed)
    pieces = []
    for file in range(rng.randint(1, 6)):
        start = rng.randint(0, 50)
        for _ in range(rng.randint(1, 5)):
            end = start + rng.choice([0, 1, 1, 2, rng.randint(3, 400)])
            pieces.append(Piece(file, start, end, aligned=rng.random() < 0.7))
            start = end + rng.choice([0, 5])
    total = sum(piece.end - piece.start for piece in pieces)

    for parts in range(1, 9):
        runs = split_pieces(pieces, parts)
        assert len(runs) == parts
        run_bytes = [sum(piece.end - piece.start for piece in run) for run in runs]
        assert sum(run_bytes) == total and max(run_bytes) - min(run_bytes) <= 1

        flat = [piece for run in runs for piece in run if piece.end > piece.start]
        for original in (piece for piece in pieces if piece.end > piece.start):
            head = flat.pop(0)
            assert (head.file, head.start, head.aligned) == (original.file, original.start, original.aligned)
            end = head.end
            while end < original.end:
                tail = flat.pop(0)
                assert (tail.file, tail.start, tail.aligned) == (original.file, end, False)
                end = tail.end
            assert end == original.end
            if original.end - original.start == 1:
                assert head == original
        assert flat == []
