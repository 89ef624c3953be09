"""GRPO on a Qwen2.5-VL from prompts with images (``data.kind: chat_media_prompts``), end to end in
the trainer on two FSDP gloo ranks: the rollout generates with the picture in the prompt, and the
packed rows the update trains on carry it.

Checked against transformers, which this project did not write: every sampled completion's
log-probabilities equal those ``Qwen2_5_VLForConditionalGeneration`` (built from the exported
config, holding the gathered weights that generated the rollout) gives the finished sequence, fed
its own image processor's pixels and computing its own M-RoPE positions (a video prompt is left
out there: transformers recomputes the positions generation continued, ``veomni/generation/prompts.py``).
And the update's rows give every completion's log-probabilities on a one-process forward of our
model (so the update sees what generation saw, the picture included), which they do not without
their media. The launcher refuses
a missing or unreadable image, markers that do not pair with images, and a record without a hidden
answer, naming file and line.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from harness.gloo_ranks import run_distributed
from models.omni.mrope_positions import token_types
from models.omni.qwen_video import encode_video_member
from tests.data.test_chat_media_jsonl import VIDEO_BUDGET
from tests.data.test_media_preference_data import CLIP_FPS, clip
from tests.omni_utils import TINY_QWEN_VL_CHAT, TOKENIZER, random_png
from tests.parity_utils import assert_parity, full_params
from tests.trainer_utils import tiny_run_config
from veomni.checkpoint.hf_io import save_hf_pretrained
from veomni.config.schema import DataConfig, ModelConfig, RunConfig
from veomni.contract import build_config, build_model
from veomni.data.chat.media_prompts import check_media_prompts_data
from veomni.objectives.grpo import ADVANTAGES
from veomni.tasks.base import IGNORE_INDEX
from veomni.train.trainer import Trainer

IMAGES = {"img/a.png": (61, 97, 0), "img/b.png": (37, 45, 1), "img/c.png": (90, 50, 2)}
"""file -> (height, width, seed) of its ``random_png``."""
MODEL = {**TINY_QWEN_VL_CHAT, **VIDEO_BUDGET}


def _turn(role: str, content) -> dict:
    return {"role": role, "content": content}


def prompt_lines() -> list[dict]:
    """Five prompts: an image, two images, none, an image in a Qwen content list after a turn, a video."""
    return [
        {"id": "p0", "images": ["img/a.png"], "question_type": "color",
         "messages": [_turn("user", "<image>What color?"), _turn("assistant", "red")]},
        {"id": "p1", "images": ["img/b.png", "img/c.png"],
         "messages": [_turn("user", "<image> or <image>?"), _turn("assistant", "left")]},
        {"id": "p2", "messages": [_turn("user", "Say two."), _turn("assistant", "two")]},
        {"id": "p3", "messages": [_turn("user", "Hi."), _turn("assistant", "Hello."),
                                  _turn("user", [{"type": "image", "image": "img/c.png"},
                                                 {"type": "text", "text": "Which way?"}]),
                                  _turn("assistant", "up")]},
        {"id": "p4", "videos": ["clips/d.npz"],
         "messages": [_turn("user", "<video>Which way?"), _turn("assistant", "up")]},
    ]


def write_prompts(folder: Path, lines: list[dict]) -> Path:
    for name, shape in IMAGES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(random_png(*shape))
    (folder / "clips" / "d.npz").parent.mkdir(parents=True, exist_ok=True)
    (folder / "clips" / "d.npz").write_bytes(encode_video_member(clip(), CLIP_FPS))
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def vlm_grpo_config(tmp_path: Path) -> RunConfig:
    cfg = tiny_run_config(tmp_path, max_steps=1, objective="grpo", lr=1e-2, eval_batches=0)
    cfg.model = ModelConfig(arch="qwen2_5_vl", options=dict(MODEL))
    path = write_prompts(tmp_path / "set", prompt_lines())
    cfg.data = DataConfig(kind="chat_media_prompts", train_path=str(path), format="jsonl", text_key="json",
                          tokenizer=str(TOKENIZER), max_seq_len=96,
                          tokens_per_micro_batch=120)  # each rank's prompts once (costs 14 to 65)
    cfg.checkpoint.interval = 0
    cfg.rl.group_size, cfg.rl.max_new_tokens = 2, 3
    return cfg


def _train(rank: int, world: int, cfg: RunConfig) -> list[tuple]:
    trainer = Trainer(cfg)
    feed, seen = trainer.feed, []
    rollout, engine_generate = feed.rollout, feed.engine.generate

    def recorded(index: int) -> list[dict]:
        weights, calls = full_params(trainer.model), []  # the trained weights, gathered, before this rollout

        def spy(prompts, params):
            out = engine_generate(prompts, params)
            calls.append(([prompt for prompt in prompts for _ in range(params.n)], out))  # a sample's own prompt
            return out
        feed.engine.generate = spy
        rows = rollout(index)
        seen.append((weights, calls, [dict(row) for row in rows]))
        return rows
    feed.rollout = recorded
    trainer.train()
    return seen


def _hf_logps(hf_model, config, sample, tokens: list[int], folder: Path) -> torch.Tensor:
    """transformers' log-probabilities of ``tokens`` after the prompt ``sample``, its images read
    from their files by transformers' own image processor."""
    ids = torch.tensor([*sample.chat.ids, *tokens])
    kwargs = {}
    line = next(line for line in prompt_lines() if line["id"] == sample.key)
    files = line.get("images") or [part["image"] for turn in line["messages"] if isinstance(turn["content"], list)
                                   for part in turn["content"] if part.get("type") == "image"]
    if files:
        vision = config.encoder_configs["image"]
        processor = Qwen2VLImageProcessorPil(min_pixels=vision.min_pixels, max_pixels=vision.max_pixels)
        pixels = processor(images=[Image.open(io.BytesIO((folder / f).read_bytes())) for f in files],
                           return_tensors="pt")
        kwargs.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
    types = token_types(ids, config.image_token_id, config.video_token_id)[None]
    with torch.no_grad():
        logits = hf_model(input_ids=ids[None], mm_token_type_ids=types, **kwargs).logits[0]
    logps = F.log_softmax(logits[:-1].float(), -1).gather(-1, ids[1:, None])[:, 0]
    return logps[len(sample.chat.ids) - 1:]


def _row_logps(model, row: dict, media: bool) -> torch.Tensor:
    """Our model's log-probabilities of a rollout row's targets (with or without its media)."""
    with torch.no_grad():
        logits = model(row["input_ids"], row["position_ids"], row["cu_seqlens"], int(row["max_seqlen"]),
                       media=row["media"] if media else None)
    targets = row["labels"] != IGNORE_INDEX
    return F.log_softmax(logits[targets].float(), -1).gather(-1, row["labels"][targets, None])[:, 0]


def test_vlm_rollouts_see_the_picture_and_equal_transformers_and_the_update_rows(tmp_path: Path) -> None:
    seen = [rollout for rank in run_distributed(_train, 2, vlm_grpo_config(tmp_path)) for rollout in rank]
    assert len(seen) == 2, "one rollout for the one step, on each rank"
    config = build_config("qwen2_5_vl", MODEL)
    _, ours = build_model("qwen2_5_vl", MODEL)
    with_images = with_video = 0
    weights = seen[0][0]  # one step: both ranks rolled out with the starting weights
    ours.load_state_dict(weights)
    hf_model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        save_hf_pretrained("qwen2_5_vl", config, weights, tmp_path / "hf")).eval()
    for other, calls, rows in seen:
        assert all(torch.equal(other[name], value) for name, value in weights.items())
        completions = []
        for prompts, out in calls:
            for sample, done in zip(prompts, out):
                completions += done.logprobs
                if sample.media.get("video"):  # transformers recomputes a video's positions (generation/prompts.py)
                    with_video += 1
                    continue
                expected = _hf_logps(hf_model, config, sample, done.tokens, tmp_path / "set")
                assert_parity(torch.tensor(done.logprobs), expected, f"rollout log-probabilities of {sample.key}")
                with_images += bool(sample.media.get("image"))
        got = torch.cat([_row_logps(ours, row, media=True) for row in rows])
        assert_parity(got, torch.tensor(completions), "the update rows' log-probabilities")
        blind = torch.cat([_row_logps(ours, row, media=False) for row in rows])
        assert (blind - got).abs().max() > 1e-3, "without their media the rows give other log-probabilities"
        assert all(ADVANTAGES in row for row in rows)
    assert with_images > 0 and with_video > 0


def test_the_launcher_refuses_bad_media_prompts_naming_file_and_line(tmp_path: Path) -> None:
    good = prompt_lines()
    path = write_prompts(tmp_path / "set", good)
    (tmp_path / "set" / "img" / "broken.png").write_bytes(random_png(40, 40, 9)[:50])
    bad = [
        {**good[0], "id": "missing_image", "images": ["img/gone.png"]},
        {**good[0], "id": "unreadable", "images": ["img/broken.png"]},
        {**good[1], "id": "two_markers_one_image", "images": ["img/b.png"]},
        {**good[0], "id": "no_answer", "messages": good[0]["messages"][:1]},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in [*good, *bad]))
    cfg = DataConfig(kind="chat_media_prompts", train_path=str(path), format="jsonl", text_key="json",
                     tokenizer=str(TOKENIZER), max_seq_len=128, tokens_per_micro_batch=160)
    problems = check_media_prompts_data(cfg, build_config("qwen2_5_vl", MODEL))
    want = {6: "image file not found: '" + str(tmp_path / "set" / "img" / "gone.png"),
            7: "image " + str(tmp_path / "set" / "img" / "broken.png") + " does not decode",
            8: "more <image> placeholders than image items", 9: "'no_answer'"}
    assert len(problems) == len(want), problems
    for problem, (line, why) in zip(problems, want.items()):
        assert problem.startswith(f"data (chat_media_prompts): {path}:{line}: "), problem
        assert why in problem, (why, problem)
