"""Videos in the chat shards under a ``qwen2_5_vl`` model (``models/omni/qwen_video.py``): a ``video.npz``
member gives the frames, patches, ``video_grid_thw``, ``second_per_grid_ts`` and token ids of Qwen's
published video processing; a loader row holding images and videos gives transformers'
``Qwen2_5_VLForConditionalGeneration`` logits per sample; malformed members stop the loader naming
the shard, the sample and the member.

The expected video patches are not transformers' video processor's (it needs torchvision, which this
environment lacks): its frame sampling is written out below from ``Qwen2VLVideoProcessor.sample_frames``,
each sampled frame goes through transformers' PIL image processor with one-frame patches (its resize,
rescale and normalisation), and pairs of frames are interleaved into (C, 2, p, p) patches as
``Qwen2VLVideoProcessor.patchify`` lays them out.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from models.omni.mrope_positions import token_types
from models.omni.qwen_video import encode_video_member
from tests.omni_utils import TINY_QWEN_VL_CHAT, TOKENIZER, qwen_vl_random_builder, random_png, write_shard
from tests.parity_utils import assert_parity
from veomni.checkpoint.hf_io import load_hf_pretrained
from veomni.config.schema import DataConfig
from veomni.contract import build_config, get_model_spec
from veomni.data.build_loader import build_dataloader
from veomni.data.chat.media_dataset import SampleProcessor
from veomni.data.sources import InvalidSampleError
from veomni.data.text.packed import load_tokenizer

VIDEO_BUDGET = dict(video_min_pixels=28 * 28 * 2, video_max_pixels=28 * 28 * 6)
# (frames, height, width, fps): odd count resampled up to 2 fps; 6 fps sampled down to 2 fps; above the budget
CLIPS = [(7, 50, 90, 1.0), (13, 61, 37, 6.0), (4, 130, 100, 2.0)]


def _frames(count: int, height: int, width: int, seed: int) -> np.ndarray:
    return (np.random.RandomState(seed).rand(count, height, width, 3) * 255).astype(np.uint8)


def _record(key: str, content: str, members: dict[str, bytes]) -> dict:
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": "left"}]
    return {"__key__": key, "json": json.dumps({"messages": messages}).encode(), **members}


def expected_video(frames: np.ndarray, fps: float, config) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(pixel_values_videos, video_grid_thw [1, 3], second_per_grid_ts) by Qwen's published video rules."""
    vision, patch = config.encoder_configs["image"], 2
    total = len(frames)
    # Qwen2VLVideoProcessor.sample_frames(metadata(fps), fps=video_fps)
    most = math.floor(min(config.video_max_frames, total) / patch) * patch
    count = min(max(total / fps * config.video_fps, config.video_min_frames), most, total)
    count = math.floor(count / patch) * patch
    indices = torch.arange(0, total, total / count).int()
    sampled_fps = len(indices) / total * fps  # VideoMetadata.sampled_fps
    images = Qwen2VLImageProcessorPil(min_pixels=config.video_min_pixels, max_pixels=config.video_max_pixels,
                                      temporal_patch_size=1)
    one = images(images=[Image.fromarray(frames[i]) for i in indices], return_tensors="pt")
    _, gh, gw = one["image_grid_thw"][0].tolist()
    p = vision.patch_size
    per_frame = one["pixel_values"].view(count // patch, patch, gh * gw, 3, p, p)  # merge-group order per frame
    pixels = per_frame.permute(0, 2, 3, 1, 4, 5).reshape(count // patch * gh * gw, 3 * patch * p * p)
    return pixels, torch.tensor([[count // patch, gh, gw]]), patch / sampled_fps


def _processor(config=None) -> SampleProcessor:
    config = config or build_config("qwen2_5_vl", {**TINY_QWEN_VL_CHAT, **VIDEO_BUDGET})
    return SampleProcessor(load_tokenizer(str(TOKENIZER)), config)


@pytest.mark.parametrize("count,height,width,fps", CLIPS)
def test_a_video_is_what_qwens_processing_makes(count, height, width, fps):
    process = _processor()
    config, tokenizer = build_config("qwen2_5_vl", {**TINY_QWEN_VL_CHAT, **VIDEO_BUDGET}), process.chat.tokenizer
    frames = _frames(count, height, width, count)
    sample = process(_record("v", "<video>\nWhere?", {"video.npz": encode_video_member(frames, fps)}))
    item = sample.media["video"][0]
    pixels, grid, seconds = expected_video(frames, fps, config)
    torch.testing.assert_close(item.inputs["grid_thw"], grid, rtol=0, atol=0)
    torch.testing.assert_close(item.inputs["patches"], pixels.float(), rtol=0, atol=1e-5)
    assert item.meta["second_per_grid_ts"] == pytest.approx(seconds, rel=1e-12)
    assert grid[0, 0] > 1  # every clip spans several temporal patches
    merged = int(grid.prod()) // 4
    # Qwen's layout of a video in the user turn: start, one <|video_pad|> per merged token, end
    prompt = "User: <|vision_start|>" + "<|video_pad|>" * merged + "<|vision_end|>"
    rest = ("\nWhere?", "\n", "Assistant: ", "left")
    want = sum((tokenizer.encode(t, add_special_tokens=False) for t in (prompt, *rest)), [])
    assert sample.chat.ids == want + [tokenizer.eos_token_id]
    assert [sample.chat.ids[i] for i in sample.chat.placeholders["video"]] == [config.video_token_id] * merged
    assert item.num_tokens == merged and sample.cost == len(sample.chat.ids) + int(grid.prod())


def test_loader_row_of_images_and_videos_gives_transformers_logits(tmp_path):
    """The tiny recipe's folder shape with every weight randomised: a packed row of an image sample, a
    video sample and a sample with a video before an image (one media entry, items in text order)
    gives per sample the logits transformers gives on ``pixel_values``, ``pixel_values_videos``,
    ``video_grid_thw`` and ``second_per_grid_ts``, computing its own M-RoPE positions."""
    reference = qwen_vl_random_builder().make_model(seed=0)
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_(0.0, 0.1)
    reference.save_pretrained(tmp_path / "hf")
    _, config, state = load_hf_pretrained(tmp_path / "hf")
    model = get_model_spec("qwen2_5_vl").instantiate(config).eval()
    model.load_state_dict(state, strict=True)
    config.video_min_pixels, config.video_max_pixels = VIDEO_BUDGET.values()
    process = _processor(config)

    clips = {1: (_frames(11, 50, 90, 1), 1.0), 2: (_frames(6, 40, 40, 2), 4.0)}
    png = random_png(61, 97, 0)
    records = [_record("s0", "<image>\nWhere?", {"png": png}),
               _record("s1", "<video>\nWhere?", {"video.npz": encode_video_member(*clips[1])}),
               _record("s2", "<video> then <image>", {"video.npz": encode_video_member(*clips[2]), "png": png})]
    batch = process.pack([process(r) for r in records])
    entry = batch["media"]["image"]  # one entry for both kinds, items in row order
    assert set(batch["media"]) == {"image"} and entry["inputs"]["grid_thw"][:, 0].tolist() == [1, 5, 2, 1]
    assert entry["positions"].diff().gt(0).all()
    with torch.no_grad():
        ours = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], batch["max_seqlen"],
                     media=batch["media"]).split(batch["cu_seqlens"].diff().tolist())

    vision = config.encoder_configs["image"]
    images = Qwen2VLImageProcessorPil(min_pixels=vision.min_pixels, max_pixels=vision.max_pixels)
    for i, got in enumerate(ours):
        ids = batch["input_ids"][batch["cu_seqlens"][i]:batch["cu_seqlens"][i + 1]]
        kwargs = {"mm_token_type_ids": token_types(ids, config.image_token_id, config.video_token_id)[None]}
        if i != 1:
            pixels = images(images=[Image.open(io.BytesIO(png))], return_tensors="pt")
            kwargs.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
        if i in clips:
            videos, grid, seconds = expected_video(*clips[i], config)
            kwargs.update(pixel_values_videos=videos, video_grid_thw=grid, second_per_grid_ts=torch.tensor([seconds]))
        with torch.no_grad():
            want = reference(input_ids=ids[None], **kwargs).logits[0]
        assert_parity(got, want, f"sample {i} logits")


def _npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


@pytest.mark.parametrize("member,why", [
    (_npz(frames=np.zeros((4, 28, 28), np.uint8), fps=2.0), r"'frames' must be uint8 \[T, H, W, 3\].*\[4, 28, 28\]"),
    (_npz(frames=np.zeros((4, 28, 28, 3), np.float32), fps=2.0), r"'frames' must be uint8.*float32"),
    (_npz(frames=np.zeros((0, 28, 28, 3), np.uint8), fps=2.0), r"'frames' holds no frame"),
    (_npz(frames=np.zeros((1, 28, 28, 3), np.uint8), fps=2.0), r"1 frame\(s\): a video needs at least 2"),
    (_npz(frames=np.zeros((4, 28, 28, 3), np.uint8)), r"no 'fps' in the archive"),
    (_npz(frames=np.zeros((4, 28, 28, 3), np.uint8), fps=0.0), r"'fps' must be one positive number"),
])
def test_a_malformed_video_member_stops_the_loader_naming_it(tmp_path, member, why):
    good = _record("good", "<video>\nWhere?", {"video.npz": encode_video_member(_frames(4, 28, 28, 0), 2.0)})
    bad = _record("clip_7", "Compare <image> with <video>", {"png": random_png(28, 28, 0), "0.video.npz": member})
    shard = write_shard(tmp_path / "d" / "shard-000003.tar", [good, bad])
    cfg = DataConfig(train_path=str(shard.parent), eval_path=str(shard.parent), tokenizer=str(TOKENIZER),
                     text_key="json", tokens_per_micro_batch=2048, max_seq_len=256)
    config = build_config("qwen2_5_vl", {**TINY_QWEN_VL_CHAT, **VIDEO_BUDGET})
    loader = build_dataloader(cfg, "eval", load_tokenizer(str(TOKENIZER)), 0, 1, 0, config, kind="chat_media")
    with pytest.raises(InvalidSampleError, match=rf"shard-000003\.tar: sample 'clip_7': member '0\.video\.npz': {why}"):
        list(loader)
