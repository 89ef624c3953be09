"""Shared pieces of the omni tests: a tiny VLM, synthetic image/audio/chat records, shard writing."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import webdataset
from PIL import Image, ImageDraw

from models.audio.processing import encode_wav
from veomni.contract import build_model

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


def png_bytes(seed: int, width: int | None = None, height: int | None = None) -> bytes:
    """A small PNG with one coloured rectangle; sizes vary with the seed."""
    rng = random.Random(seed)
    width, height = width or rng.randint(28, 84), height or rng.randint(28, 84)
    image = Image.new("RGB", (width, height), (250, 250, 250))
    color = tuple(rng.randint(0, 255) for _ in range(3))
    ImageDraw.Draw(image).rectangle((2, 2, width // 2, height // 2), fill=color)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def wav_bytes(seed: int, seconds: float) -> bytes:
    """A 16 kHz WAV of one sine tone (its pitch varies with the seed)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return encode_wav(0.5 * np.sin(2 * np.pi * rng.uniform(200, 2000) * t), 16000)


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
