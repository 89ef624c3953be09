"""The ``chat_media_preference`` kind (``veomni/data/chat/media_preference.py``): preference pairs with
images and a video in the prompt, as a jsonl naming files (markers with ``images`` / ``videos`` lists,
Qwen's content lists, TRL's pathless ``{"type": "image"}`` parts) and as webdataset shards, give the
same rows tensor for tensor; each half carries the prompt's media and its own M-RoPE positions,
targets on its reply only; malformed pairs (missing chosen, empty rejected, a missing or unreadable
image, media in a reply, a pair over the budget) are refused at launch naming file and record."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from models.omni.qwen_video import encode_video_member
from tests.data.test_chat_media_jsonl import VIDEO_BUDGET, _flat
from tests.omni_utils import TINY_OMNI, TINY_QWEN_VL_CHAT, TOKENIZER, random_png, write_shard
from veomni.config.schema import DataConfig
from veomni.contract import build_config
from veomni.data.build_loader import build_dataloader
from veomni.data.chat.media_preference import check_media_preference_data
from veomni.data.text.packed import load_tokenizer
from veomni.tasks.base import IGNORE_INDEX

ANSWERS = [("red", "Red."), ("left", "Left."), ("two", "Two."), ("up", "Up.")]
"""(rejected, chosen) replies of each pair: the SFT form and a preferred one."""


def _turn(role: str, content) -> dict:
    return {"role": role, "content": content}


def qwen_config():
    return build_config("qwen2_5_vl", {**TINY_QWEN_VL_CHAT, **VIDEO_BUDGET})


CLIP_FPS = 2.0
PAIR_IMAGES = {"img/a.png": (61, 97, 0), "img/b.png": (37, 45, 1), "img/c.png": (90, 50, 2)}
"""file -> (height, width, seed) of its ``random_png``."""
PAIR_MEDIA = [["img/a.png", "img/b.png"], [], ["img/c.png", "clips/d.npz"], ["img/a.png"]]
"""Each pair's media files, in prompt order."""


def clip() -> np.ndarray:
    """The frames of the pairs' video (``clips/d.npz``, at ``CLIP_FPS``)."""
    return (np.random.RandomState(5).rand(6, 40, 52, 3) * 255).astype(np.uint8)


def media_pairs(folder: Path) -> tuple[Path, Path]:
    """Four pairs (two images, none, an image and a video, Qwen's and TRL's content lists) as a jsonl
    naming files under ``folder/set`` and as one shard: ``(jsonl, shard folder)``."""
    files = {name: random_png(*shape) for name, shape in PAIR_IMAGES.items()}
    files["clips/d.npz"] = encode_video_member(clip(), CLIP_FPS)
    for name, raw in files.items():
        (folder / "set" / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / "set" / name).write_bytes(raw)
    replies = [{"chosen": [_turn("assistant", chosen)], "rejected": [_turn("assistant", rejected)]}
               for rejected, chosen in ANSWERS]
    lines = [
        {"id": "v0", "images": ["img/a.png", "img/b.png"], "prompt": [_turn("user", "<image> or <image>?")],
         **replies[0]},
        {"id": "v1", "prompt": [_turn("system", "Be brief."), _turn("user", "Left or right?")], **replies[1]},
        {"id": "v2", "prompt": [_turn("user", [{"type": "image", "image": "img/c.png"},
                                               {"type": "text", "text": "How many?"},
                                               {"type": "video", "video": "clips/d.npz"}])], **replies[2]},
        {"id": "v3", "images": ["img/a.png"],
         "prompt": [_turn("user", "Hi."), _turn("assistant", "Hello."),
                    _turn("user", [{"type": "image"}, {"type": "text", "text": "Which way?"}])], **replies[3]},
    ]
    shard = [
        {"json": {"prompt": [_turn("user", "<image> or <image>?")], **replies[0]},
         "0.png": files["img/a.png"], "1.png": files["img/b.png"]},
        {"json": {"prompt": lines[1]["prompt"], **replies[1]}},
        {"json": {"prompt": [_turn("user", "<image>How many?<video>")], **replies[2]},
         "png": files["img/c.png"], "video.npz": files["clips/d.npz"]},
        {"json": {"prompt": [*lines[3]["prompt"][:2], _turn("user", "<image>Which way?")], **replies[3]},
         "png": files["img/a.png"]},
    ]
    jsonl = folder / "set" / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = [{"__key__": f"v{i}", **members, "json": json.dumps({"id": f"v{i}", **members["json"]}).encode()}
               for i, members in enumerate(shard)]
    return jsonl, write_shard(folder / "shards" / "shard-000000.tar", records).parent


def data_cfg(path: Path | str, **overrides) -> DataConfig:
    return DataConfig(**{"kind": "chat_media_preference", "train_path": str(path), "eval_path": str(path),
                         "tokenizer": str(TOKENIZER), "text_key": "json", "max_seq_len": 256,
                         "tokens_per_micro_batch": 1200, "shuffle": False, **overrides})


def pair_rows(path: Path | str, config, **overrides) -> list[dict]:
    cfg = data_cfg(path, **overrides)
    return list(build_dataloader(cfg, "eval", load_tokenizer(str(TOKENIZER)), 0, 1, 0, config,
                                 kind="chat_media_preference"))


def _halves(batch: dict):
    bounds = batch["cu_seqlens"].tolist()
    return [(a, b) for a, b in zip(bounds, bounds[1:])]


def test_jsonl_pairs_give_the_rows_of_their_shards_with_media_in_both_halves(tmp_path: Path) -> None:
    jsonl, shards = media_pairs(tmp_path)
    config = qwen_config()
    want, got = pair_rows(shards, config), pair_rows(jsonl, config)
    assert [k for b in want for k, _ in _flat(b)] == [k for b in got for k, _ in _flat(b)]
    for a, b in zip(want, got):
        for (name, x), (_, y) in zip(_flat(a), _flat(b)):
            torch.testing.assert_close(y, x, rtol=0, atol=0, msg=name)
    tokenizer = load_tokenizer(str(TOKENIZER))
    seen = 0
    for batch in got:
        halves = _halves(batch)
        assert len(halves) % 2 == 0
        image_places = batch["media"]["image"]["positions"]
        for (c0, c1), (r0, r1) in zip(halves[0::2], halves[1::2]):
            rejected, chosen = ANSWERS[seen]
            for (start, stop), reply in (((c0, c1), chosen), ((r0, r1), rejected)):
                labels = batch["labels"][start:stop]
                assert tokenizer.decode(labels[labels != IGNORE_INDEX].tolist()) == reply + tokenizer.eos_token
            prompt = int((batch["labels"][c0:c1] != IGNORE_INDEX).nonzero()[0]) + 1
            assert torch.equal(batch["input_ids"][c0:c0 + prompt], batch["input_ids"][r0:r0 + prompt])
            # each half holds the prompt's image and video features at the same offsets, positions alike
            chosen_places = image_places[(image_places >= c0) & (image_places < c1)] - c0
            rejected_places = image_places[(image_places >= r0) & (image_places < r1)] - r0
            assert torch.equal(chosen_places, rejected_places) and (len(chosen_places) > 0) == (seen != 1)
            assert torch.equal(batch["position_ids"][c0:c0 + prompt], batch["position_ids"][r0:r0 + prompt])
            seen += 1
    assert seen == 4
    grids = torch.cat([b["media"]["image"]["inputs"]["grid_thw"] for b in got])
    assert len(grids) == 2 * 5, "every image and the video once per half"


def test_a_seed_style_omni_model_reads_the_same_pairs(tmp_path: Path) -> None:
    """The Seed1.5-VL-style family: ``<image>`` markers, 1-D positions, no video form."""
    jsonl, _ = media_pairs(tmp_path)
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    images_only = jsonl.with_name("images.jsonl")
    images_only.write_text("".join(json.dumps(line) + "\n" for line in (lines[0], lines[1], lines[3])))
    config = build_config("omni", TINY_OMNI)
    batches = pair_rows(images_only, config)
    halves = [h for b in batches for h in _halves(b)]
    assert len(halves) == 6
    assert sum(len(b["media"]["image"]["inputs"]["grid_thw"]) for b in batches) == 2 * 3
    assert check_media_preference_data(data_cfg(images_only), config) == []


def _refusals(tmp_path: Path, lines: list[dict], config=None, **overrides) -> list[str]:
    path = tmp_path / "set" / "bad.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return check_media_preference_data(data_cfg(path, eval_path=None, **overrides), config or qwen_config())


def test_malformed_pairs_are_refused_at_launch_naming_file_and_record(tmp_path: Path) -> None:
    jsonl, shards = media_pairs(tmp_path)
    good = [json.loads(line) for line in jsonl.read_text().splitlines()]
    (tmp_path / "set" / "img" / "broken.png").write_bytes(random_png(40, 40, 9)[:50])
    bad = [
        {**good[0], "id": "no_chosen", "chosen": None},
        {**good[1], "id": "empty_rejected", "rejected": []},
        {**good[0], "id": "missing_image", "images": ["img/a.png", "img/gone.png"]},
        {**good[3], "id": "unreadable", "images": ["img/broken.png"]},
        {**good[0], "id": "image_in_reply", "chosen": [_turn("assistant", "<image> Red.")]},
        {**good[0], "id": "two_markers_one_image", "images": ["img/a.png"]},
    ]
    problems = _refusals(tmp_path, [*good, *bad])
    bad_file = str(tmp_path / "set" / "bad.jsonl")
    want = {5: "'no_chosen': 'chosen' is not a list", 6: "'empty_rejected': 'rejected' is empty",
            7: "'missing_image': image file not found: '" + str(tmp_path / "set" / "img" / "gone.png"),
            8: "'unreadable': image " + str(tmp_path / "set" / "img" / "broken.png") + " does not decode",
            9: "'image_in_reply': the chosen reply holds <image>",
            10: "'two_markers_one_image': more <image> placeholders than image items"}
    assert len(problems) == len(want), problems
    for problem, (line, why) in zip(problems, want.items()):
        assert problem.startswith(f"data (chat_media_preference): {bad_file}:{line}: "), problem
        assert why in problem, (why, problem)
    assert _refusals(tmp_path, good) == []
    assert check_media_preference_data(data_cfg(shards), qwen_config()) == []


def test_a_pair_over_the_budget_is_refused_with_its_cost(tmp_path: Path) -> None:
    jsonl, shards = media_pairs(tmp_path)
    for path in (jsonl, shards):
        problems = check_media_preference_data(data_cfg(path, tokens_per_micro_batch=150), qwen_config())
        assert any("'v2' has" in p and "text tokens and encoder patches (chosen" in p and
                   "data.tokens_per_micro_batch=150" in p for p in problems), problems
    problems = check_media_preference_data(data_cfg(jsonl, max_seq_len=20), qwen_config())
    assert any("'v1': its chosen half has" in p and "over data.max_seq_len=20" in p for p in problems), problems


@pytest.mark.parametrize("kind", ["chat_media", "chat_preference"])
def test_the_objectives_read_pairs_only(kind: str) -> None:
    from veomni.config.schema import RunConfig
    from veomni.objectives import objective_problems

    cfg = RunConfig()
    cfg.train.objective = "dpo"
    assert objective_problems(cfg, "chat_media_preference") == []
    assert (objective_problems(cfg, kind) == []) == (kind == "chat_preference")
