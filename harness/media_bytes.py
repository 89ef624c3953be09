"""Synthetic media items for tests and benchmarks: a PNG of one coloured rectangle, a WAV of one tone."""

from __future__ import annotations

import io
import random

import numpy as np
from PIL import Image, ImageDraw

from models.audio.processing import encode_wav


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
