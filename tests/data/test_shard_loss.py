"""A truncated webdataset shard counts every record its builder manifest lists but did not yield
(not one), so ``data.max_bad_fraction`` trips on a large shard cut short: for the chat (VQA)
stream and the frames kind, cut mid-record or cleanly at a record boundary; a shard without a
manifest count still counts its damage as one bad record (~2 s)."""

from __future__ import annotations

import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.media_bytes import png_bytes
from tests.clip_shards import write_clip_shards
from tests.omni_utils import TINY_OMNI, TOKENIZER, chat_record, write_shard
from veomni.config.schema import DataConfig
from veomni.contract import build_config
from veomni.data.build_loader import build_dataloader
from veomni.data.builders import MANIFEST, publish_split
from veomni.data.kinds import DatasetRequest
from veomni.data.sources import BadDataError
from veomni.data.text.packed import load_tokenizer
from veomni.data.video.frames import FramesDataset

RECORDS_PER_SHARD = 8
MEMBERS_PER_RECORD = 2  # json + png, or frames.npy + json


def _published(staging: Path) -> Path:
    """The staged shards as a builder publishes them: with ``shard_records`` in the manifest."""
    out = staging.with_name("split")
    publish_split(staging, out, {"format_version": 1})
    return out


def _chat_split(tmp_path: Path) -> Path:
    for shard in range(2):
        records = [chat_record(f"s{shard}_{i:02d}", "What color is it?", "red", png_bytes(i))
                   for i in range(RECORDS_PER_SHARD)]
        write_shard(tmp_path / "staging" / f"shard-{shard}.tar", records)
    return _published(tmp_path / "staging")


def _clip_split(tmp_path: Path) -> Path:
    return _published(write_clip_shards(tmp_path / "staging", clips=2 * RECORDS_PER_SHARD, shards=2))


def _cut(shard: Path, how: str) -> None:
    """Truncate ``shard`` to half its bytes (mid-record), or end it at record 4's first header with
    an end-of-archive (a valid tar of 4 records: nothing but the manifest says records are missing)."""
    if how == "half":
        shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
        return
    with tarfile.open(shard) as tar:
        at = tar.getmembers()[4 * MEMBERS_PER_RECORD].offset
    shard.write_bytes(shard.read_bytes()[:at] + bytes(2 * tarfile.BLOCKSIZE))


def _read_chat(split: Path, max_bad_fraction: float) -> tuple[int, int]:
    """(samples yielded, bad records counted) of one eval pass of the chat loader."""
    cfg = DataConfig(train_path=str(split), eval_path=str(split), tokenizer=str(TOKENIZER), text_key="json",
                     tokens_per_micro_batch=2048, max_seq_len=256, max_bad_fraction=max_bad_fraction)
    loader = build_dataloader(cfg, "eval", load_tokenizer(str(TOKENIZER)), 0, 1, 0, build_config("omni", TINY_OMNI),
                              kind="chat_media")
    samples = sum(batch["num_samples"] for batch in loader)
    return samples, loader.dataset.state_dict()["sources"]["eval"]["bad_prior_epochs"]


def _read_frames(split: Path, max_bad_fraction: float) -> tuple[int, int]:
    """(images yielded, bad records counted) of one eval pass of the frames kind."""
    cfg = DataConfig(train_path=str(split), eval_path=str(split), tokens_per_micro_batch=4,
                     max_bad_fraction=max_bad_fraction)
    dataset = FramesDataset(DatasetRequest(cfg, str(split), "eval", None, 0, 1, 0, SimpleNamespace(sample_size=16)))
    images = sum(len(batch["images"]) for batch in dataset)
    return images, dataset.skipped


@pytest.mark.parametrize("how", ["half", "boundary"])
@pytest.mark.parametrize("make, read, shard", [(_chat_split, _read_chat, "shard-1.tar"),
                                               (_clip_split, _read_frames, "shard-00001.tar")],
                         ids=["chat", "frames"])
def test_a_cut_shard_counts_the_records_its_manifest_lists(tmp_path, make, read, shard, how):
    split = make(tmp_path)
    _cut(split / shard, how)
    good, bad = read(split, max_bad_fraction=0.5)
    assert good + bad == 2 * RECORDS_PER_SHARD and bad >= RECORDS_PER_SHARD // 2  # every lost record, not 1
    assert how == "half" or bad == RECORDS_PER_SHARD - 4  # a clean end, short of the manifest's count
    with pytest.raises(BadDataError, match=rf"{bad} of {2 * RECORDS_PER_SHARD} records were bad.*{shard}"):
        read(split, max_bad_fraction=0.2)


def test_without_a_manifest_count_a_cut_shard_is_one_bad_record(tmp_path):
    split = _chat_split(tmp_path)
    (split / MANIFEST).unlink()
    _cut(split / "shard-1.tar", "half")
    good, bad = _read_chat(split, max_bad_fraction=0.5)
    assert bad == 1 and good < 2 * RECORDS_PER_SHARD - 1
