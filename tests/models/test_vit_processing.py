"""ViT input processing: smart_resize budgets, patch order, normalisation, video frames."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from models.vit.config import CLIP_MEAN, CLIP_STD
from models.vit.processing import image_to_patches, patch_positions, patchify, smart_resize, video_to_patches

FACTOR = 28


def _sizes() -> list[tuple[int, int]]:
    rng = np.random.default_rng(0)
    return [tuple(int(v) for v in rng.integers(10, 3000, size=2)) for _ in range(300)] + [
        (1, 150),
        (4000, 20),
    ]


@pytest.mark.parametrize("min_pixels, max_pixels", [(4 * 28 * 28, 64 * 28 * 28), (28 * 28, 1024 * 28 * 28)])
def test_smart_resize_respects_factor_budget_and_aspect(min_pixels, max_pixels) -> None:
    for height, width in _sizes():
        h, w = smart_resize(height, width, FACTOR, min_pixels, max_pixels)
        assert h % FACTOR == 0 and w % FACTOR == 0 and h > 0 and w > 0
        assert h * w <= max_pixels, (height, width, h, w)
        if max(height, width) / min(height, width) <= 4:  # no side clamped to one block
            assert h * w >= min_pixels, (height, width, h, w)
        if min(h, w) >= 4 * FACTOR:  # each side is off by less than one block from the scaled size
            drift = abs(math.log((h / w) / (height / width)))
            assert drift < 2.5 * FACTOR / min(h, w), (height, width, h, w)


def test_smart_resize_examples_worked_by_hand() -> None:
    # within budget: nearest multiples (50 -> 56, 90 -> 84)
    assert smart_resize(50, 90, 28, 28 * 28, 28 * 28 * 16) == (56, 84)
    # over budget: scale sqrt(12544 / 2e6) = 0.0792 -> 79.2 x 158.4, floored to 56 x 140
    assert smart_resize(1000, 2000, 28, 28 * 28, 28 * 28 * 16) == (56, 140)
    # under budget: scale sqrt(4 * 784 / 100) = 5.6 -> 56 x 56 exactly
    assert smart_resize(10, 10, 28, 4 * 28 * 28, 28 * 28 * 16) == (56, 56)


@pytest.mark.parametrize(
    "args, message",
    [
        ((10, 3000, 28, 784, 10**6), "aspect ratio"),
        ((0, 30, 28, 784, 10**6), "positive"),
        ((100, 100, 28, 784, 700), "max_pixels"),
    ],
)
def test_smart_resize_rejects_bad_input(args, message) -> None:
    with pytest.raises(ValueError, match=message):
        smart_resize(*args)


def _expected_positions(grid: list[tuple[int, int, int]], m: int) -> list[tuple[int, int, int]]:
    """The documented order, written as plain loops: frame, merged row, merged col, then the
    m x m group in raster order."""
    out = []
    for t, gh, gw in grid:
        for f in range(t):
            for a in range(gh // m):
                for b in range(gw // m):
                    for i in range(m):
                        for j in range(m):
                            out.append((f, a * m + i, b * m + j))
    return out


def test_patch_positions_follow_merge_group_major_order() -> None:
    grid = [(1, 4, 6), (3, 2, 4), (1, 6, 2)]
    got = patch_positions(torch.tensor(grid), 2)
    assert got.tolist() == [list(p) for p in _expected_positions(grid, 2)]


def test_patchify_puts_each_crop_where_patch_positions_says() -> None:
    p, m = 3, 2
    frames = torch.randn(2, 3, 4 * p, 6 * p)
    patches = patchify(frames, p, m)
    positions = patch_positions(torch.tensor([[2, 4, 6]]), m)
    assert patches.shape == (2 * 4 * 6, 3 * p * p)
    for patch, (f, row, col) in zip(patches, positions.tolist()):
        crop = frames[f, :, row * p : (row + 1) * p, col * p : (col + 1) * p]
        assert torch.equal(patch, crop.reshape(-1))


def test_image_to_patches_normalises_and_reports_grid() -> None:
    color = (200, 30, 90)
    image = Image.new("RGB", (90, 50), color)  # PIL size is (width, height)
    patches, grid = image_to_patches(image, 14, 2, 28 * 28, 28 * 28 * 16)
    assert grid == (1, 56 // 14, 84 // 14)
    assert patches.shape == (4 * 6, 3 * 14 * 14) and patches.dtype == torch.float32
    expected = [(c / 255 - mu) / sd for c, mu, sd in zip(color, CLIP_MEAN, CLIP_STD)]
    per_channel = patches.view(-1, 3, 14 * 14)
    for channel, value in enumerate(expected):
        torch.testing.assert_close(per_channel[:, channel], torch.full_like(per_channel[:, channel], value))


def test_image_to_patches_keeps_content_in_place() -> None:
    """A 56x84 image is not resized: its top-left 14x14 block is the first patch."""
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, size=(56, 84, 3), dtype=np.uint8)
    patches, grid = image_to_patches(
        Image.fromarray(pixels), 14, 2, 28 * 28, 28 * 28 * 16, (0, 0, 0), (1, 1, 1)
    )
    assert grid == (1, 4, 6)
    first = torch.from_numpy(pixels[:14, :14].astype(np.float32) / 255).permute(2, 0, 1).reshape(-1)
    torch.testing.assert_close(patches[0], first)
    second_group_first = torch.from_numpy(pixels[:14, 28:42].astype(np.float32) / 255).permute(2, 0, 1)
    torch.testing.assert_close(patches[4], second_group_first.reshape(-1))


def test_video_frames_share_a_size_and_a_total_budget() -> None:
    frames = [Image.new("RGB", (160, 120), (i * 40, 0, 0)) for i in range(4)]
    patches, (t, gh, gw) = video_to_patches(frames, 14, 2, 28 * 28, 28 * 28 * 64)
    assert t == 4 and patches.shape == (4 * gh * gw, 3 * 14 * 14)
    _, (_, gh_small, gw_small) = video_to_patches(
        frames, 14, 2, 28 * 28, 28 * 28 * 64, max_total_pixels=4 * 28 * 28 * 4
    )
    assert gh_small * gw_small * 14 * 14 <= 28 * 28 * 4 < gh * gw * 14 * 14
    with pytest.raises(ValueError, match="same size"):
        video_to_patches(frames + [Image.new("RGB", (100, 100))], 14, 2, 28 * 28, 28 * 28 * 64)
