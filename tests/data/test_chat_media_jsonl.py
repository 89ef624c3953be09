"""Chat samples with media from a jsonl that names image and video files (``veomni/data/chat/media_jsonl.py``)
give the loader rows the equivalent webdataset shards give, tensor for tensor (token ids, labels, M-RoPE
positions, patches, grids, placeholder positions): images and a video under a ``qwen2_5_vl`` model, in
both record layouts (``images`` / ``videos`` lists with markers, Qwen's content lists), relative and
absolute paths; a file that is missing is skipped and counted as a bad record, naming it."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from models.omni.qwen_video import encode_video_member
from tests.omni_utils import TINY_QWEN_VL_CHAT, TOKENIZER, random_png, write_shard
from veomni.config.schema import DataConfig
from veomni.contract import build_config
from veomni.data.build_loader import build_dataloader
from veomni.data.sources import BadDataError
from veomni.data.text.packed import load_tokenizer

VIDEO_BUDGET = dict(video_min_pixels=28 * 28 * 2, video_max_pixels=28 * 28 * 6)


def _turns(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def _video(seed: int) -> bytes:
    frames = (np.random.RandomState(seed).rand(6, 40, 52, 3) * 255).astype(np.uint8)
    return encode_video_member(frames, 2.0)


def _data(tmp_path):
    """The same five samples as shards and as a jsonl with its files: ``(shard folder, jsonl file)``."""
    files = {"img/a.png": random_png(61, 97, 0), "img/b.jpg": random_png(37, 23, 1), "clips/c.npz": _video(2)}
    for name, raw in files.items():
        (tmp_path / "set" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "set" / name).write_bytes(raw)
    absolute = tmp_path / "elsewhere" / "d.png"
    absolute.parent.mkdir()
    absolute.write_bytes(random_png(50, 50, 3))
    samples = [  # (jsonl record, shard members)
        ({"messages": _turns("<image>\nWhere?", "left"), "images": ["img/a.png"]},
         {"json": _turns("<image>\nWhere?", "left"), "png": files["img/a.png"]}),
        ({"messages": _turns("No picture here.", "ok")}, {"json": _turns("No picture here.", "ok")}),
        ({"messages": _turns("<image> or <image>?", "first"), "images": ["img/b.jpg", str(absolute)]},
         {"json": _turns("<image> or <image>?", "first"), "0.jpg": files["img/b.jpg"],
          "1.png": absolute.read_bytes()}),
        ({"conversations": [{"from": "human", "value": "<video>\nWhich way?"}, {"from": "gpt", "value": "up"}],
          "videos": ["clips/c.npz"]},
         {"json": _turns("<video>\nWhich way?", "up"), "video.npz": files["clips/c.npz"]}),
        ({"messages": [{"role": "user", "content": [{"type": "video", "video": "clips/c.npz"},
                                                    {"type": "text", "text": " then "},
                                                    {"type": "image", "image": "file://" + str(absolute)}]},
                       {"role": "assistant", "content": "both"}]},
         {"json": _turns("<video> then <image>", "both"), "video.npz": files["clips/c.npz"],
          "png": absolute.read_bytes()}),
    ]
    jsonl = tmp_path / "set" / "chat.jsonl"
    jsonl.write_text("".join(json.dumps(record) + "\n" for record, _ in samples))
    records = [{"__key__": f"s{i}", **members, "json": json.dumps({"messages": members["json"]}).encode()}
               for i, (_, members) in enumerate(samples)]
    return write_shard(tmp_path / "shards" / "shard-000000.tar", records).parent, jsonl


def _rows(path: str, tmp_path) -> list[dict]:
    cfg = DataConfig(train_path=path, eval_path=path, tokenizer=str(TOKENIZER), text_key="json",
                     tokens_per_micro_batch=300, max_seq_len=256, shuffle=False)
    config = build_config("qwen2_5_vl", {**TINY_QWEN_VL_CHAT, **VIDEO_BUDGET})
    return list(build_dataloader(cfg, "eval", load_tokenizer(str(TOKENIZER)), 0, 1, 0, config, kind="chat_media"))


def _flat(batch, prefix=""):
    for key, value in sorted(batch.items()):
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            yield prefix + key, value


def test_a_jsonl_naming_files_gives_the_rows_of_its_shards(tmp_path):
    shards, jsonl = _data(tmp_path)
    want, got = _rows(str(shards), tmp_path), _rows(str(jsonl), tmp_path)
    assert len(want) == len(got) and sum(len(b["cu_seqlens"]) - 1 for b in want) == 5
    assert sum(len(b["media"].get("image", {}).get("inputs", {}).get("grid_thw", [])) for b in want) == 6
    for a, b in zip(want, got):
        assert [k for k, _ in _flat(a)] == [k for k, _ in _flat(b)]
        for (name, x), (_, y) in zip(_flat(a), _flat(b)):
            torch.testing.assert_close(y, x, rtol=0, atol=0, msg=name)


def test_a_missing_file_is_skipped_counted_and_named(tmp_path, caplog):
    _, jsonl = _data(tmp_path)
    (tmp_path / "set" / "img" / "b.jpg").unlink()
    with caplog.at_level(logging.WARNING), pytest.raises(BadDataError, match=r"1 of 5 records were bad"):
        _rows(str(jsonl), tmp_path)
    assert "FileNotFoundError" in caplog.text and "img/b.jpg" in caplog.text
