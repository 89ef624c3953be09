"""The multimodal chat loader: corrupt images skipped and counted, placeholder/media mismatches
fail naming the sample, packing counts text tokens plus patches, labels only on answers, and
exact resume."""

from __future__ import annotations

import logging

import pytest
import torch

from harness.media_bytes import png_bytes
from tests.omni_utils import TINY_OMNI, TOKENIZER, chat_record, write_shard
from veomni.config.schema import DataConfig
from veomni.contract import build_config
from veomni.data.build_loader import build_dataloader
from veomni.data.sources import InvalidSampleError
from veomni.data.text.packed import load_tokenizer


def _config():
    return build_config("omni", TINY_OMNI)


def _loader(path, split="eval", budget=2048, **overrides):
    cfg = DataConfig(
        train_path=str(path),
        eval_path=str(path),
        tokenizer=str(TOKENIZER),
        text_key="json",
        tokens_per_micro_batch=budget,
        **{"max_seq_len": 256, **overrides},
    )
    return build_dataloader(cfg, split, load_tokenizer(str(TOKENIZER)), 0, 1, 0, _config(), kind="chat_media")


def _records(n: int, start: int = 0) -> list[dict]:
    return [
        chat_record(f"s{i:03d}", "What color is it?", ["red", "blue", "green"][i % 3], png_bytes(i))
        for i in range(start, start + n)
    ]


def test_corrupt_image_is_skipped_and_counted(tmp_path, caplog):
    corrupt = chat_record("broken", "What color is it?", "red", png_bytes(99)[:40])
    write_shard(tmp_path / "d" / "shard-0.tar", [*_records(3), corrupt, *_records(2, start=3)])
    loader = _loader(tmp_path / "d", max_bad_fraction=0.5)
    with caplog.at_level(logging.WARNING):
        batches = list(loader)
    assert sum(b["num_samples"] for b in batches) == 5
    assert sum(int(b["media"]["image"]["inputs"]["grid_thw"].shape[0]) for b in batches) == 5
    assert loader.dataset.state_dict()["sources"]["eval"]["bad_prior_epochs"] == 1  # skipped records of the pass
    assert "broken" in caplog.text and "does not decode" in caplog.text


def test_more_placeholders_than_images_fails_naming_the_sample(tmp_path):
    bad = chat_record("two_markers", "<image> and again <image>", "red", png_bytes(1))
    write_shard(tmp_path / "d" / "shard-0.tar", [*_records(2), bad])
    with pytest.raises(InvalidSampleError, match="'two_markers'.*more <image> placeholders than image items"):
        list(_loader(tmp_path / "d"))


def test_image_without_placeholder_fails_naming_the_sample(tmp_path):
    bad = chat_record("no_marker", "x", "red", png_bytes(1))
    bad["json"] = bad["json"].replace(b"<image>", b"")
    write_shard(tmp_path / "d" / "shard-0.tar", [bad])
    with pytest.raises(InvalidSampleError, match="'no_marker'.*1 image item"):
        list(_loader(tmp_path / "d"))


def test_several_images_per_sample_keep_their_order(tmp_path):
    record = chat_record("pair", "Compare <image> with", "same", png_bytes(1, 28, 56))
    record.pop("png")
    record["0.png"], record["1.png"] = png_bytes(1, 28, 56), png_bytes(2, 84, 84)
    write_shard(tmp_path / "d" / "shard-0.tar", [record])
    batch = next(iter(_loader(tmp_path / "d")))
    assert batch["media"]["image"]["inputs"]["grid_thw"].tolist() == [[1, 4, 2], [1, 6, 6]]
    positions = batch["media"]["image"]["positions"]
    assert positions.numel() == 2 + 9 and (positions.diff()[:1] == 1).all()


def test_packing_budget_counts_text_tokens_and_patches(tmp_path):
    write_shard(tmp_path / "d" / "shard-0.tar", _records(12))
    budget = 200
    batches = list(_loader(tmp_path / "d", budget=budget, max_seq_len=100))
    assert sum(b["num_samples"] for b in batches) == 12
    for batch in batches:
        patches = int(batch["media"]["image"]["inputs"]["patches"].shape[0])
        assert batch["input_ids"].numel() + patches <= budget
    assert max(b["num_samples"] for b in batches) < 12  # the budget split them


def test_labels_are_the_answer_tokens_only(tmp_path):
    write_shard(tmp_path / "d" / "shard-0.tar", _records(3))
    batch = next(iter(_loader(tmp_path / "d")))
    tokenizer = load_tokenizer(str(TOKENIZER))
    targets = batch["labels"][batch["labels"] != -100].tolist()
    expected = [
        t
        for answer in ("red", "blue", "green")
        for t in tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    ]
    assert targets == expected


def test_resume_continues_with_the_next_batch(tmp_path):
    write_shard(tmp_path / "d" / "shard-0.tar", _records(20))
    loader = _loader(tmp_path / "d", split="train", budget=300, max_seq_len=100)
    it = iter(loader)
    next(it)
    next(it)
    state = loader.state_dict()
    expected = [next(it) for _ in range(3)]
    resumed = _loader(tmp_path / "d", split="train", budget=300, max_seq_len=100)
    resumed.load_state_dict(state)
    it = iter(resumed)
    for want in expected:
        got = next(it)
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(
            got["media"]["image"]["inputs"]["patches"], want["media"]["image"]["inputs"]["patches"]
        )
