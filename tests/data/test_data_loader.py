"""Loader: sources, dp split, exact resume, layout change, bad data handling."""

import io
import json
import logging
import random
import tarfile
from itertools import pairwise
from pathlib import Path

import pytest
import torch
import webdataset

from veomni.config.schema import DataConfig
from veomni.data.build_loader import build_dataloader
from veomni.data.packing import chunk_document
from veomni.data.sources import BadDataError
from veomni.data.text.packed import load_tokenizer, merge_loader_states
from veomni.tasks import IGNORE_INDEX

TOKENIZER = Path(__file__).resolve().parents[2] / "data" / "tokenizers" / "stdlib-bpe-8k"
MAX_SEQ_LEN, BUDGET = 64, 160
WORDS = ["def", "class", "return", "import", "self", "value", "data", "yield", "lambda", "tensor", "token"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(TOKENIZER))


def make_docs(n: int, seed: int = 0) -> list[str]:
    """Documents of 1..150 words, each unique, some longer than MAX_SEQ_LEN tokens."""
    rng = random.Random(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 150))) for i in range(n)]


def write_shards(folder: Path, docs: list[str], per_shard: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for shard, first in enumerate(range(0, len(docs), per_shard)):
        with webdataset.TarWriter(str(folder / f"shard-{shard:04d}.tar")) as writer:
            for i, text in enumerate(docs[first : first + per_shard], first):
                writer.write({"__key__": f"d{i:05d}", "txt": text})
    return folder


def config(path: Path, **overrides) -> DataConfig:
    defaults = {
        "train_path": str(path),
        "eval_path": str(path),
        "max_seq_len": MAX_SEQ_LEN,
        "tokens_per_micro_batch": BUDGET,
        "max_bad_fraction": 0.0,
    }
    return DataConfig(**{**defaults, **overrides})


def expected_chunks(tokenizer, docs: list[str]) -> list[list[int]]:
    chunks = []
    for text in docs:
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        chunks.extend(list(chunk) for _, chunk in chunk_document(ids, MAX_SEQ_LEN))
    return chunks


def samples_of(batch: dict) -> list[list[int]]:
    ids, cu = batch["input_ids"].tolist(), batch["cu_seqlens"].tolist()
    return [ids[a:b] for a, b in pairwise(cu)]


def take(loader, n: int) -> list[dict]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def dataset_state(loader) -> dict:
    return loader.state_dict()["dataset_state"]


def source_state(loader, name: str = "eval") -> dict:
    """The position of one source (``eval`` / ``train`` name the single source of those splits)."""
    return loader.dataset.state_dict()["sources"][name]


@pytest.fixture(scope="module")
def docs():
    return make_docs(60)


@pytest.fixture(scope="module")
def shards(tmp_path_factory, docs):
    return write_shards(tmp_path_factory.mktemp("corpus"), docs, per_shard=25)


def test_eval_pass_yields_every_chunk_in_order_with_contract(tokenizer, docs, shards):
    batches = list(build_dataloader(config(shards), "eval", tokenizer, 0, 1, seed=0))
    assert [s for b in batches for s in samples_of(b)] == expected_chunks(tokenizer, docs)
    assert any(len(tokenizer.encode(d)) + 1 > MAX_SEQ_LEN for d in docs)  # chunking was exercised
    for batch in batches:
        n = batch["input_ids"].numel()
        assert 0 < n <= BUDGET
        cu = batch["cu_seqlens"]
        assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == n and len(cu) == batch["num_samples"] + 1
        lengths = (cu[1:] - cu[:-1]).tolist()
        assert batch["max_seqlen"] == max(lengths) <= MAX_SEQ_LEN
        assert batch["position_ids"].tolist() == [p for length in lengths for p in range(length)]
        for a, b in pairwise(cu.tolist()):
            assert batch["labels"][a : b - 1].tolist() == batch["input_ids"][a + 1 : b].tolist()
            assert batch["labels"][b - 1] == IGNORE_INDEX
    # greedy: a batch is only closed when the next sample would not fit
    for batch, following in pairwise(batches):
        assert batch["input_ids"].numel() + len(samples_of(following)[0]) > BUDGET


@pytest.mark.parametrize("dp_size", [3, 5])
def test_dp_ranks_read_disjoint_shards_that_cover_the_corpus(tokenizer, docs, shards, dp_size):
    """Three shards of 25, 25 and 10 documents: at 3 ranks each reads whole shards, at 5 ranks the
    shards are cut into byte ranges; either way each document once, in file order per rank."""
    got = []
    for rank in range(dp_size):
        mine = [s for b in build_dataloader(config(shards), "eval", tokenizer, rank, dp_size, 0) for s in samples_of(b)]
        assert mine, f"rank {rank} got nothing"
        got.append(mine)
    assert sorted(s for mine in got for s in mine) == sorted(expected_chunks(tokenizer, docs))
    if dp_size == 3:
        assert sorted(got) == sorted(expected_chunks(tokenizer, docs[a:a + 25]) for a in (0, 25, 50))


def test_train_loops_over_epochs_with_shuffled_shard_order(tokenizer, docs, shards):
    loader = build_dataloader(config(shards), "train", tokenizer, 0, 1, seed=3)
    per_epoch = len(expected_chunks(tokenizer, docs))
    samples, it = [], iter(loader)
    while len(samples) < 3 * per_epoch:
        samples.extend(samples_of(next(it)))
    epochs = [samples[e * per_epoch : (e + 1) * per_epoch] for e in range(3)]
    assert all(sorted(e) == sorted(expected_chunks(tokenizer, docs)) for e in epochs)
    assert len({tuple(map(tuple, e)) for e in epochs}) > 1  # shard order changes with the epoch
    assert source_state(loader, "train")["epoch"] >= 2


@pytest.mark.parametrize(
    "split,rank,dp_size,num_workers",
    [("train", 0, 1, 0), ("train", 1, 2, 0), ("eval", 0, 2, 0), ("train", 1, 2, 2)],
)
def test_exact_resume(tokenizer, shards, split, rank, dp_size, num_workers):
    cfg = config(shards, num_workers=num_workers)
    total = 40 if split == "train" else len(list(build_dataloader(cfg, split, tokenizer, rank, dp_size, 7)))
    reference = take(build_dataloader(cfg, split, tokenizer, rank, dp_size, 7), total)
    for k in (0, 1, total // 2, total - 1):
        loader = build_dataloader(cfg, split, tokenizer, rank, dp_size, 7)
        head = take(loader, k)
        state = loader.state_dict()
        resumed = build_dataloader(cfg, split, tokenizer, rank, dp_size, 7)
        resumed.load_state_dict(state)
        tail = take(resumed, total - k)
        for got, want in zip(head + tail, reference, strict=True):
            assert got.keys() == want.keys()
            assert all(
                torch.equal(got[key], want[key]) if torch.is_tensor(want[key]) else got[key] == want[key]
                for key in want
            )


def test_resume_tokenizes_one_window_not_the_skipped_documents(tokenizer, shards):
    class CountingTokenizer:
        eos_token_id = tokenizer.eos_token_id
        calls = 0

        def encode(self, text, add_special_tokens):
            CountingTokenizer.calls += 1
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    cfg = config(shards, shuffle_window=4)
    loader = build_dataloader(cfg, "train", CountingTokenizer(), 0, 1, 0)
    take(loader, 12)
    state = loader.state_dict()
    CountingTokenizer.calls = 0
    resumed = build_dataloader(cfg, "train", CountingTokenizer(), 0, 1, 0)
    resumed.load_state_dict(state)
    take(resumed, 1)
    assert CountingTokenizer.calls <= 4 + BUDGET // 2  # the resumed window's rest and one batch's documents
    assert source_state(resumed, "train")["piece"] > 0 or source_state(resumed, "train")["offset"] > 0


def test_state_from_another_layout_is_rejected(tokenizer, shards):
    old = build_dataloader(config(shards), "train", tokenizer, 0, 2, 0)
    take(old, 3)
    new = build_dataloader(config(shards), "train", tokenizer, 0, 1, 0)
    with pytest.raises(ValueError, match="merge_loader_states"):
        new.load_state_dict(old.state_dict())


def test_merge_loader_states_needs_every_old_rank(tokenizer, shards):
    states = []
    for rank in range(2):
        loader = build_dataloader(config(shards), "train", tokenizer, rank, 2, 0)
        take(loader, 2)
        states.append(loader.state_dict())
    with pytest.raises(ValueError, match="every rank"):
        merge_loader_states(states[:1])
    assert merge_loader_states(states + states)  # a rank's state saved twice (its sp peers) counts once


def test_workers_split_and_merge_from_worker_states(tokenizer, docs, shards):
    cfg = config(shards, num_workers=2)
    everything = [s for b in build_dataloader(cfg, "eval", tokenizer, 0, 1, 0) for s in samples_of(b)]
    assert sorted(everything) == sorted(expected_chunks(tokenizer, docs))  # workers split, no duplicates

    old = build_dataloader(cfg, "eval", tokenizer, 0, 1, 0)
    consumed = [s for b in take(old, 5) for s in samples_of(b)]
    merged = merge_loader_states([old.state_dict()])
    new_samples = []
    for rank in range(2):  # new layout: 2 ranks, no workers
        loader = build_dataloader(config(shards), "eval", tokenizer, rank, 2, 0)
        loader.load_state_dict(merged)
        new_samples += [s for b in loader for s in samples_of(b)]
    # the old workers' prefetched batches were never yielded: they are read again, none is lost
    assert sorted(consumed + new_samples) == sorted(expected_chunks(tokenizer, docs))


def test_corrupt_and_truncated_shards_are_skipped_and_counted(tokenizer, docs, tmp_path, caplog):
    folder = write_shards(tmp_path / "c", docs[:40], per_shard=20)
    data = (folder / "shard-0000.tar").read_bytes()
    (folder / "shard-0000.tar").write_bytes(data[: len(data) // 2 + 100])  # truncated mid-member
    (folder / "shard-0001b.tar").write_bytes(b"this is not a tar file" * 50)  # garbage
    cfg = config(folder, max_bad_fraction=0.5)
    with caplog.at_level(logging.WARNING, logger="veomni.data.sources"):
        loader = build_dataloader(cfg, "eval", tokenizer, 0, 1, 0)
        got = [s for b in loader for s in samples_of(b)]
    state = source_state(loader)
    assert state["bad_prior_epochs"] == 2
    kept = len(docs[:40]) - (state["records_prior_epochs"] - 2)  # documents lost in the truncated tail
    assert 0 < kept < 20
    assert got == expected_chunks(tokenizer, docs[: 20 - kept] + docs[20:40])
    assert "shard-0000.tar" in caplog.text and "shard-0001b.tar" in caplog.text


def test_bad_jsonl_records_and_tar_members_are_skipped(tokenizer, docs, tmp_path):
    lines = [
        json.dumps({"txt": docs[0]}),
        "{broken json",
        json.dumps({"other": "x"}),
        json.dumps({"txt": docs[1]}),
        "",
        json.dumps({"txt": 5}),
    ]
    (tmp_path / "a.jsonl").write_bytes(("\n".join(lines) + "\n").encode() + b'{"txt": "\xff\xfe"}\n')
    loader = build_dataloader(config(tmp_path / "a.jsonl", max_bad_fraction=0.9), "eval", tokenizer, 0, 1, 0)
    assert [s for b in loader for s in samples_of(b)] == expected_chunks(tokenizer, docs[:2])
    assert source_state(loader)["bad_prior_epochs"] == 4

    tar = tmp_path / "t" / "x.tar"
    tar.parent.mkdir()
    with tarfile.open(tar, "w") as archive:
        for name, payload in [("a.txt", docs[2].encode()), ("b.json", b"{}"), ("c.txt", b"\xff\xfe")]:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))
    loader = build_dataloader(config(tar.parent, max_bad_fraction=0.9), "eval", tokenizer, 0, 1, 0)
    assert [s for b in loader for s in samples_of(b)] == expected_chunks(tokenizer, docs[2:3])
    assert source_state(loader)["bad_prior_epochs"] == 2


def test_bad_fraction_over_threshold_raises(tokenizer, docs, tmp_path):
    lines = [json.dumps({"txt": d}) for d in docs[:10]] + ["not json"] * 2
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    loader = build_dataloader(config(tmp_path, max_bad_fraction=0.1), "eval", tokenizer, 0, 1, 0)
    with pytest.raises(BadDataError, match=r"2 of 12 records.*bad\.jsonl"):
        list(loader)
    assert len(list(build_dataloader(config(tmp_path, max_bad_fraction=0.2), "eval", tokenizer, 0, 1, 0))) > 0


def test_format_auto_reads_jsonl_folder(tokenizer, docs, tmp_path):
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[3:5]))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:3]))
    loader = build_dataloader(config(tmp_path, text_key="text"), "eval", tokenizer, 0, 1, 0)
    assert [s for b in loader for s in samples_of(b)] == expected_chunks(tokenizer, docs[:5])


def test_missing_or_empty_path_is_a_clear_error(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        build_dataloader(config(tmp_path / "nowhere"), "train", tokenizer, 0, 1, 0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        build_dataloader(config(tmp_path / "empty"), "train", tokenizer, 0, 1, 0)
    with pytest.raises(FileNotFoundError, match="no-tokenizer"):
        load_tokenizer(str(tmp_path / "no-tokenizer"))


def test_shipped_tokenizer(tokenizer):
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id not in (None, 0)
    assert len(tokenizer) == 8192
    text = "def f(x):\n    return x  # naïve ✓\n"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
