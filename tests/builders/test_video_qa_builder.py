"""The video QA builder (``data/build_video_qa.py``): its answers agree with the pixels (a direction with
the shape's motion from the first frame to the last), its shards read through the ``chat_media`` loader
under the tiny video recipe's model as videos of several temporal patches with M-RoPE time positions
from ``second_per_grid_ts``, builds are deterministic and cached, and the eval manifest holds the
majority baseline the VQA eval compares with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from models.omni.qwen_video import read_video_member
from veomni.config.load import load_config
from veomni.contract import build_config
from veomni.data.build_loader import build_dataloader
from veomni.data.builders import load_script
from veomni.data.sources import ReadStats, iter_tar_samples, resolve_files
from veomni.data.text.packed import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
BUILDER = REPO / "data" / "build_video_qa.py"
RECIPE = REPO / "recipes" / "qwen2.5-vl" / "tiny_video.yaml"
TRAIN, HELD_OUT = 40, 24
WAYS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
"""What the direction words mean as (dy, dx) on screen (y grows downward), not the builder's table."""


def _build(root: Path) -> str:
    command = [sys.executable, str(BUILDER), "--train-out", str(root / "train"), "--eval-out", str(root / "eval"),
               "--train-samples", str(TRAIN), "--eval-samples", str(HELD_OUT)]
    return subprocess.run(command, capture_output=True, text=True, check=True, timeout=120).stdout


def _records(split: Path) -> list[dict]:
    stats = ReadStats()
    records = [{k: v for k, v in r.items() if k != "__url__"}
               for r in iter_tar_samples(resolve_files(str(split))[1], 0.0, stats)]
    assert stats.bad == 0
    return records


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("video_qa")
    assert "majority-class baseline" in _build(root)
    return root


def _centroid(frame: np.ndarray) -> np.ndarray:
    distance = np.abs(frame.astype(float) - frame[0, 0]).sum(-1)  # the corner is background
    return np.argwhere(distance > 0.5 * distance.max()).mean(0)


def test_every_answer_agrees_with_the_clip(built):
    builder = load_script(BUILDER)
    records = _records(built / "train") + _records(built / "eval")
    assert len(records) == TRAIN + HELD_OUT
    for record in records:
        meta = json.loads(record["json"])
        qtype, (user, answer) = meta["question_type"], (m["content"] for m in meta["messages"])
        assert user == f"<video>\n{builder.QUESTIONS[qtype]}"
        frames, fps = read_video_member(record["video.npz"])
        assert frames.shape == (8, 56, 56, 3) and fps == 2.0
        if qtype == "direction":
            moved = _centroid(frames[-1]) - _centroid(frames[0])
            assert max(WAYS, key=lambda way: moved @ np.array(WAYS[way])) == answer, record["__key__"]
    manifest = json.loads((built / "eval" / "manifest.json").read_text())
    assert set(manifest["majority_baseline"]) == {"direction", "color", "shape"}
    assert manifest["samples"] == HELD_OUT and manifest["clip"] == {"frames": 8, "height": 56, "width": 56, "fps": 2.0}


def test_loader_rows_hold_videos_with_time_positions(built):
    """Under the recipe's model a clip is 4 temporal patches of 2 x 2 merged tokens (16 <|video_pad|>
    tokens, 64 patches); with 1 s per temporal patch and tokens_per_second 2 its M-RoPE time positions
    step by 2: (t, h, w) = start + (2k, row, column)."""
    cfg = load_config(RECIPE, [f"--data.train_path={built / 'train'}", f"--data.eval_path={built / 'eval'}"])
    model = build_config("qwen2_5_vl", cfg.model.options)
    loader = build_dataloader(cfg.data, "eval", load_tokenizer(cfg.data.tokenizer), 0, 1, 0, model, kind="chat_media")
    want = torch.tensor([[2 * k, row, column] for k in range(4) for row in range(2) for column in range(2)])
    clips = 0
    for batch in loader:
        grids = batch["media"]["image"]["inputs"]["grid_thw"]
        assert grids.tolist() == [[4, 4, 4]] * len(grids)
        video = (batch["input_ids"] == model.video_token_id).nonzero().flatten().view(len(grids), 16)
        for tokens in video:
            positions = batch["position_ids"][tokens]
            torch.testing.assert_close(positions - positions[0], want, rtol=0, atol=0)
        clips += len(grids)
    assert clips == HELD_OUT


def test_builds_are_deterministic_and_cached(built, tmp_path):
    assert "cached" in _build(built)
    _build(tmp_path)
    for split in ("train", "eval"):
        assert _records(tmp_path / split) == _records(built / split)
