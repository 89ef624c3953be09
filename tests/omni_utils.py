"""Shared pieces of the omni tests: a tiny VLM, synthetic image/audio/chat records, shard writing."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import webdataset
from PIL import Image

from veomni.contract import build_model
from veomni.data.builders import load_script

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "data" / "tokenizers" / "stdlib-bpe-8k"

TINY_OMNI = dict(
    llm=dict(
        vocab_size=8200,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        family="qwen3",
        qk_norm=True,
    ),
    encoders=dict(
        image=dict(
            hidden_size=32,
            num_layers=2,
            num_heads=2,
            intermediate_size=64,
            out_hidden_size=32,
            min_pixels=28 * 28,
            max_pixels=84 * 84,
        )
    ),
)


def tiny_omni(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config, model = build_model("omni", {**TINY_OMNI, **overrides})
    model.init_weights()
    return config, model


def chat_record(
    key: str, question: str, answer: str, image: bytes | None = None, qtype: str = "color"
) -> dict:
    """A webdataset record in the bundled VQA format; ``image=None`` gives a text-only sample."""
    content = f"<image>\n{question}" if image is not None else question
    meta = {
        "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}],
        "question_type": qtype,
    }
    record = {"__key__": key, "json": json.dumps(meta).encode()}
    if image is not None:
        record["png"] = image
    return record


def write_shard(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with webdataset.TarWriter(str(path)) as writer:
        for record in records:
            writer.write(record)
    return path


def build_vqa(out: Path, train: int, held_out: int) -> str:
    """``data/build_vqa.py`` into ``out/train`` and ``out/eval``; its report."""
    command = [sys.executable, str(REPO / "data" / "build_vqa.py"), "--train-out", str(out / "train"),
               "--eval-out", str(out / "eval"), "--train-samples", str(train), "--eval-samples", str(held_out)]
    return subprocess.run(command, capture_output=True, text=True, check=True, timeout=120).stdout


TINY_QWEN_VL_CHAT = dict(
    llm=dict(vocab_size=8200, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=8, family="qwen2", qkv_bias=True, qk_norm=False, tie_embeddings=False,
             mrope_section=[1, 1, 2], max_position_embeddings=256),
    encoders={"image": dict(patch_size=14, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=48,
                            hidden_act="silu", merge_mode="concat", out_hidden_size=32, temporal_patch_size=2,
                            norm="rmsnorm", mlp="gated", window_size=56, full_attention_layers=[1],
                            min_pixels=28 * 28, max_pixels=84 * 84)},
    # the bundled tokenizer's 8192 tokens, then the layout's four in id order (QwenVLConfig.media_layout)
    vision_start_token_id=8192, vision_end_token_id=8193, image_token_id=8194, video_token_id=8195,
    tokens_per_second=2,
)
"""A tiny ``qwen2_5_vl`` model that reads the chat shards with the bundled tokenizer (tests of its data)."""


def tiny_qwen_vl_chat(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config, model = build_model("qwen2_5_vl", {**TINY_QWEN_VL_CHAT, **overrides})
    model.init_weights()
    return config, model


def random_png(height: int, width: int, seed: int) -> bytes:
    """A PNG of uniform noise (every pixel differs, so resizing and patch order show)."""
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def qwen_vl_random_builder():
    """``data/build_qwen_vl_random.py`` as a module (its ``make_model`` builds the tiny recipe's folder shape)."""
    return load_script(REPO / "data" / "build_qwen_vl_random.py")
