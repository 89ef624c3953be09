"""Videos in the chat shards, read with Qwen2-VL / Qwen2.5-VL's processor rules (the ``qwen2_5_vl`` family's
``<video>`` items, a ``MediaForm`` of its image tower).

Why a member of decoded frames and not an mp4: decoding a video file needs a video library the project
does not depend on, and Qwen's recipe samples a clip at a low, fixed rate (2 frames per second) before
the model sees it anyway, so a shard holding those frames stays small and the loader stays
dependency-free. The member is ``<key>.video.npz`` (several: ``<key>.0.video.npz``, ``<key>.1.video.npz``,
... in marker order), a numpy ``.npz`` archive (``encode_video_member``) of

- ``frames``: uint8 [T, H, W, 3], RGB, every frame the same size;
- ``fps``: one positive number, the rate of those frames (frames per second of the clip).

A member that reads but breaks this (no ``fps``, frames of another shape or type, no frame, fewer
frames than one temporal patch) is a ``BadMediaMember``: the loader stops naming the shard, sample
and member. The processing is transformers' ``Qwen2VLVideoProcessor`` with ``do_sample_frames``
at ``fps = QwenVLConfig.video_fps``, then its Qwen2.5-VL processor's ``second_per_grid_ts``:

1. ``qwen_frame_indices``: ``n = T / fps * video_fps`` frames, at least ``video_min_frames`` and at
   most ``video_max_frames`` and ``T``, floored to a multiple of the temporal patch (2: an even
   count); frames ``arange(0, T, T / n)``, truncated.
2. every frame resized by ``qwen_smart_resize`` to the same multiple of 28 within the video budget
   ``video_min_pixels`` / ``video_max_pixels`` (Qwen's 128 and 768 merged tokens' worth of pixels per
   frame), PIL bicubic, CLIP normalisation, cut into (C, 2, 14, 14) patches two frames deep
   (``models/vit/processing.py``): ``grid_thw`` (n/2, h/14, w/14).
3. ``second_per_grid_ts = temporal_patch_size / (n / T * fps)``: the seconds one temporal patch spans,
   which turns into M-RoPE time positions (``QwenVLConfig.position_ids``).

transformers resizes video frames with torchvision's tensor bicubic; this uses PIL's, as its PIL
image processor does for images (the two differ by interpolation rounding, not by size).
"""

from __future__ import annotations

import io
import math

import numpy as np
import torch
from PIL import Image

from models.vit.config import ViTConfig
from models.vit.processing import qwen_smart_resize, video_to_patches
from veomni.contract.media import BadMediaMember, MediaItem

FIELD = "video.npz"
FORMAT = "an .npz with 'frames' (uint8 [T, H, W, 3], RGB) and 'fps' (the frames' rate)"


def encode_video_member(frames: np.ndarray, fps: float) -> bytes:
    """The ``<key>.video.npz`` member of a clip's sampled frames (uint8 [T, H, W, 3]) at ``fps``."""
    buffer = io.BytesIO()
    np.savez_compressed(buffer, frames=np.asarray(frames, dtype=np.uint8), fps=np.float64(fps))
    return buffer.getvalue()


def read_video_member(raw: bytes) -> tuple[np.ndarray, float]:
    """(frames uint8 [T, H, W, 3], fps) of a member; ``BadMediaMember`` saying what is wrong with it.
    Bytes that are not an archive raise numpy's own error (a damaged member)."""
    loaded = np.load(io.BytesIO(raw), allow_pickle=False)
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise BadMediaMember(f"a video member is {FORMAT}; this one is a single .npy array")
    with loaded as archive:
        missing = [name for name in ("frames", "fps") if name not in archive.files]
        if missing:
            raise BadMediaMember(f"no {' or '.join(map(repr, missing))} in the archive (it has {archive.files}); "
                                 f"a video member is {FORMAT}")
        frames, fps = archive["frames"], archive["fps"]
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or 0 in frames.shape[1:3]:
        raise BadMediaMember(f"'frames' must be uint8 [T, H, W, 3] (RGB), got {frames.dtype} {list(frames.shape)}")
    if frames.shape[0] == 0:
        raise BadMediaMember("'frames' holds no frame")
    if fps.size != 1 or not np.issubdtype(fps.dtype, np.number) or not math.isfinite(rate := float(fps.item())) \
            or rate <= 0:
        raise BadMediaMember(f"'fps' must be one positive number (the frames' rate), got {fps!r}")
    return frames, rate


def qwen_frame_indices(total: int, fps: float, video_fps: float, temporal_patch_size: int, min_frames: int,
                       max_frames: int) -> list[int]:
    """The frames of a ``total``-frame clip at ``fps`` that Qwen samples at ``video_fps`` (module
    docstring, step 1: transformers' ``sample_frames``); ``BadMediaMember`` when not even one
    temporal patch of frames is left."""
    most = math.floor(min(max_frames, total) / temporal_patch_size) * temporal_patch_size
    count = min(max(total / fps * video_fps, min_frames), most, total)
    count = math.floor(count / temporal_patch_size) * temporal_patch_size
    if count == 0:
        raise BadMediaMember(f"{total} frame(s): a video needs at least {temporal_patch_size} (one temporal patch); "
                             "give a single still as an image")
    return torch.arange(0, total, total / count).int()[:count].tolist()


def process_qwen_video(raw: bytes, cfg: ViTConfig, *, fps: float, min_frames: int, max_frames: int,
                       min_pixels: int, max_pixels: int) -> MediaItem:
    """A ``video.npz`` member -> the tower's item: patches and ``grid_thw`` (t > 1 for clips over one
    temporal patch), ``meta["second_per_grid_ts"]``; costs its patches, as an image does."""
    frames, rate = read_video_member(raw)
    indices = qwen_frame_indices(len(frames), rate, fps, cfg.temporal_patch_size, min_frames, max_frames)
    patches, grid = video_to_patches([Image.fromarray(frames[i]) for i in indices], cfg.patch_size,
                                     cfg.merge_size, min_pixels, max_pixels, cfg.image_mean, cfg.image_std,
                                     temporal_patch_size=cfg.temporal_patch_size, resize=qwen_smart_resize)
    seconds = cfg.temporal_patch_size / (len(indices) / len(frames) * rate)
    return MediaItem(inputs={"patches": patches, "grid_thw": torch.tensor([grid], dtype=torch.long)},
                     num_tokens=patches.shape[0] // cfg.merge_size**2, cost=patches.shape[0],
                     meta={"second_per_grid_ts": seconds})
