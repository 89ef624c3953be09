"""Images and video frames -> flattened patches in the ViT's packing order (pure torch/PIL/numpy).

One image of ``gh x gw`` patches (``t`` frames for a video) becomes ``[t * gh * gw, C * p * p]``.
Patch order is merge-group-major, ``(t, gh/m, gw/m, m, m)``: every ``m * m`` consecutive
patches form one merge group (the neighbours the adapter pools into one token), and the
merged tokens come out in raster order over ``(gh/m, gw/m)``, frame after frame.
``patch_positions`` is the one definition of that order; the model reads it back from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from .config import CLIP_MEAN, CLIP_STD

MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The ``(height, width)`` to resize to: both multiples of ``factor``, close to the original
    aspect ratio, and ``height * width <= max_pixels`` (hard limit) and ``>= min_pixels`` (a
    floor that yields to ``max_pixels``).

    Sides are rounded to the nearest multiple when that fits the budget, else the image is
    scaled down (up) uniformly to the budget first and the sides floored (ceiled).
    """
    if min(height, width) <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"aspect ratio of a {height}x{width} image exceeds {MAX_ASPECT_RATIO}; crop or pad it first"
        )
    if max_pixels < factor * factor:
        raise ValueError(f"max_pixels ({max_pixels}) is below one {factor}x{factor} block")

    def snap(side: float, rounding) -> int:
        return max(factor, rounding(side / factor) * factor)

    h, w = snap(height, round), snap(width, round)
    if h * w > max_pixels:
        scale = math.sqrt(max_pixels / (height * width))
        h, w = snap(height * scale, math.floor), snap(width * scale, math.floor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h, w = snap(height * scale, math.ceil), snap(width * scale, math.ceil)
    while h * w > max_pixels:  # only when the factor floor kept a thin side from shrinking
        if h >= w:
            h -= factor
        else:
            w -= factor
    return h, w


def qwen_smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL / Qwen2.5-VL's own rule (transformers' ``qwen2_vl`` ``smart_resize``, step for step, so
    the same image gets the same grid): sides rounded to multiples of ``factor``; above
    ``max_pixels`` scaled down and floored, below ``min_pixels`` scaled up and ceiled. Unlike
    ``smart_resize`` it keeps no hard limit when a side floors to ``factor``."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio of a {height}x{width} image exceeds {MAX_ASPECT_RATIO}; crop or pad it first")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _normalised(
    image: Image.Image, size_hw: tuple[int, int], mean: Sequence[float], std: Sequence[float]
) -> torch.Tensor:
    """RGB image resized (bicubic) to ``size_hw`` -> float32 [3, H, W], ``(x / 255 - mean) / std``."""
    height, width = size_hw
    rgb = image.convert("RGB")
    if rgb.size != (width, height):
        rgb = rgb.resize((width, height), resample=Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.asarray(rgb, dtype=np.float32) / 255.0)  # [H, W, 3]
    pixels = (pixels - torch.tensor(mean, dtype=torch.float32)) / torch.tensor(std, dtype=torch.float32)
    return pixels.permute(2, 0, 1)


def patchify(frames: torch.Tensor, patch_size: int, merge_size: int, temporal_patch_size: int = 1) -> torch.Tensor:
    """[t, C, H, W] -> [t/T * gh * gw, C * T * p * p] in merge-group-major order (module docstring);
    a patch spans ``T = temporal_patch_size`` consecutive frames, its values in (C, T, p, p) order
    (Qwen-VL's ``pixel_values``); ``t`` must be a multiple of ``T``."""
    t, channels, height, width = frames.shape
    p, m, tp = patch_size, merge_size, temporal_patch_size
    if height % (p * m) or width % (p * m):
        raise ValueError(
            f"frame size {height}x{width} is not a multiple of patch_size * merge_size = {p * m}"
        )
    if t % tp:
        raise ValueError(f"{t} frames do not fill temporal patches of {tp} frames")
    gh, gw = height // p, width // p
    x = frames.reshape(t // tp, tp, channels, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t/T, gh/m, gw/m, m(row), m(col), C, T, p(row), p(col)
    return x.reshape(t // tp * gh * gw, channels * tp * p * p)


def image_to_patches(
    image: Image.Image,
    patch_size: int,
    merge_size: int,
    min_pixels: int,
    max_pixels: int,
    mean: Sequence[float] = CLIP_MEAN,
    std: Sequence[float] = CLIP_STD,
    temporal_patch_size: int = 1,
    resize=smart_resize,
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One image -> (patches float32 [gh * gw, 3 * T * p * p], grid_thw ``(1, gh, gw)`` in patches).

    With temporal patches of ``T`` frames the image is repeated over them (as Qwen-VL's processor
    does: a still image is one temporal patch). ``resize``: the sizing rule (``smart_resize``, or
    ``qwen_smart_resize`` for a Qwen-VL model)."""
    width, height = image.size
    size_hw = resize(height, width, patch_size * merge_size, min_pixels, max_pixels)
    frame = _normalised(image, size_hw, mean, std)[None]
    patches = patchify(frame.expand(temporal_patch_size, -1, -1, -1), patch_size, merge_size, temporal_patch_size)
    return patches, (1, size_hw[0] // patch_size, size_hw[1] // patch_size)


def video_to_patches(
    frames: Sequence[Image.Image],
    patch_size: int,
    merge_size: int,
    min_pixels: int,
    max_pixels: int,
    mean: Sequence[float] = CLIP_MEAN,
    std: Sequence[float] = CLIP_STD,
    max_total_pixels: int | None = None,
    temporal_patch_size: int = 1,
    resize=smart_resize,
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Frames of one video (all the same size) -> (patches [t/T * gh * gw, 3 * T * p * p], ``(t/T, gh, gw)``).

    Every frame is resized to the same multiple of ``patch_size * merge_size`` by the sizing rule
    ``resize`` (``smart_resize``, or ``qwen_smart_resize`` for a Qwen-VL model). The per-frame
    budget is ``max_pixels``, lowered to ``max_total_pixels // t`` when that is given, so a
    longer clip gets smaller frames (Seed1.5-VL samples video under a token budget). A patch spans
    ``T = temporal_patch_size`` consecutive frames (Qwen-VL: 2); ``t`` must be a multiple of it.
    """
    if not frames:
        raise ValueError("a video needs at least one frame")
    sizes = {frame.size for frame in frames}
    if len(sizes) != 1:
        raise ValueError(f"all frames of a video must have the same size, got {sorted(sizes)}")
    width, height = frames[0].size
    factor = patch_size * merge_size
    budget = max_pixels if max_total_pixels is None else min(max_pixels, max_total_pixels // len(frames))
    if budget < factor * factor:
        raise ValueError(
            f"max_total_pixels={max_total_pixels} leaves {budget} pixels per frame for {len(frames)} frames, "
            f"below one {factor}x{factor} block; sample fewer frames or raise the budget"
        )
    size_hw = resize(height, width, factor, min(min_pixels, budget), budget)
    stacked = torch.stack([_normalised(frame, size_hw, mean, std) for frame in frames])
    grid = (len(frames) // temporal_patch_size, size_hw[0] // patch_size, size_hw[1] // patch_size)
    return patchify(stacked, patch_size, merge_size, temporal_patch_size), grid


def patch_positions(grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """(frame, row, col) [N, 3] of every patch of a packed batch, in the order ``patchify`` writes.

    ``grid_thw`` is [num_images, 3]; rows and columns are in patches, frames count from 0 in
    each video. The ViT rotates by (row, col); ``frame`` is the video time index.
    """
    m = merge_size
    positions = []
    for t, gh, gw in grid_thw.tolist():
        rows = torch.arange(gh, device=grid_thw.device).view(gh // m, m, 1, 1).expand(gh // m, m, gw // m, m)
        cols = torch.arange(gw, device=grid_thw.device).view(1, 1, gw // m, m).expand(gh // m, m, gw // m, m)
        hw = torch.stack([rows.permute(0, 2, 1, 3).flatten(), cols.permute(0, 2, 1, 3).flatten()], dim=-1)
        frame = torch.arange(t, device=grid_thw.device).repeat_interleave(gh * gw)
        positions.append(torch.cat([frame[:, None], hw.repeat(t, 1)], dim=-1))
    return torch.cat(positions)


def window_order(grid_thw: torch.Tensor, merge_size: int, window_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2.5-VL's attention windows over a packed batch: ``(order, window_sizes)``.

    ``order`` [N / m^2] lists the merge groups (merged tokens) window by window: each frame's
    ``gh/m x gw/m`` grid of merged tokens is cut into ``window_tokens``-square windows from the top
    left (the last row and column of windows may be smaller), read in raster order of windows and
    of tokens inside each; frames and images follow each other. ``x.view(-1, m*m, d)[order]``
    puts the patches window-major; ``order.argsort()`` undoes it. ``window_sizes`` [n_windows]
    counts patches per window (the attention segments). Same windows and order as transformers'
    ``get_vision_window_index``.
    """
    orders, sizes, offset = [], [], 0
    for t, gh, gw in grid_thw.tolist():
        rows, cols = gh // merge_size, gw // merge_size
        index = torch.arange(t * rows * cols).view(t, rows, cols)
        for frame in index:
            for top in range(0, rows, window_tokens):
                for left in range(0, cols, window_tokens):
                    window = frame[top:top + window_tokens, left:left + window_tokens].flatten()
                    orders.append(window + offset)
                    sizes.append(window.numel() * merge_size**2)
        offset += t * rows * cols
    return torch.cat(orders), torch.tensor(sizes, dtype=torch.long)
