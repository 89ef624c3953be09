"""The raw captioned-clip sample format (``data/build_moving_shapes.py`` writes it), in one place.

Why a module: the clip builder, the latent precompute (``data/build_video_latents.py``) and the
readers of raw frames (a VAE's training data) must agree on what a clip sample is and on what
makes one corrupt. A sample of a webdataset shard holds two members:

- ``frames.npy``: ``numpy.save`` bytes of a uint8 array [F, H, W, 3] (an image is a 1-frame clip);
- ``json``: ``{"caption", "colour", "shape", "size", "direction", "speed", "frames", "height",
  "width", ...}`` whose ``frames``/``height``/``width`` equal the array's shape.

:func:`decode_clip` returns the checked clip or raises :class:`CorruptClipError`, which readers
count as a skipped sample (never a crash, never silent garbage).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from veomni.errors import BadData

FRAMES_MEMBER = "frames.npy"
JSON_MEMBER = "json"
REQUIRED_FIELDS = ("caption", "frames", "height", "width")


class CorruptClipError(BadData):
    """A clip sample that cannot be read or contradicts itself."""


@dataclass
class Clip:
    key: str
    frames: np.ndarray
    """uint8 [F, H, W, 3]."""
    meta: dict[str, Any]


def encode_frames(frames: np.ndarray) -> bytes:
    """``frames.npy`` member bytes of a uint8 [F, H, W, 3] array."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(frames), allow_pickle=False)
    return buffer.getvalue()


def decode_clip(sample: dict[str, Any]) -> Clip:
    """A webdataset sample dict (member suffix -> bytes) -> :class:`Clip`; raises
    :class:`CorruptClipError` naming the key and what is wrong."""
    key = sample.get("__key__", "?")
    missing = [m for m in (FRAMES_MEMBER, JSON_MEMBER) if m not in sample]
    if missing:
        raise CorruptClipError(f"clip {key}: no {', '.join(missing)} member")
    try:
        meta = json.loads(sample[JSON_MEMBER])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CorruptClipError(f"clip {key}: json member does not parse ({error})") from error
    if not isinstance(meta, dict) or any(name not in meta for name in REQUIRED_FIELDS):
        raise CorruptClipError(f"clip {key}: json lacks one of {REQUIRED_FIELDS}")
    try:
        frames = np.load(io.BytesIO(sample[FRAMES_MEMBER]), allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        raise CorruptClipError(f"clip {key}: frames.npy does not load ({error})") from error
    expected = (meta["frames"], meta["height"], meta["width"], 3)
    if frames.dtype != np.uint8 or frames.shape != expected:
        raise CorruptClipError(f"clip {key}: frames are {frames.dtype} {list(frames.shape)}, "
                               f"the json says uint8 {list(expected)}")
    return Clip(key, frames, meta)
