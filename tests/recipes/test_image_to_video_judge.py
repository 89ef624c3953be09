"""The image-to-video judge (scripts/eval_image_to_video.py) on clips whose motion is known: the
ground truth scores a perfect first frame, no centroid error and its own direction; the copied-frame
baseline keeps the first frame but is read as still and drifts from the moving shape; a clip that
moves the other way is wrong on direction though its first frame is right."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from veomni.data.builders import load_script

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "data"))
sys.path.insert(0, str(REPO / "scripts"))
from eval_image_to_video import judge, psnr  # noqa: E402
from moving_shapes_analysis import ShapesAnalyser  # noqa: E402


@pytest.fixture(scope="module")
def clips():
    builder = load_script(REPO / "data" / "build_moving_shapes.py")
    train = [builder.make_clip(np.random.default_rng([0, i]), False) for i in range(1000, 1300)]
    moving = [c for c in (builder.make_clip(np.random.default_rng([0, i]), True) for i in range(60))
              if len(c[0]) > 1 and c[1]["speed"] == "fast"]
    return ShapesAnalyser().fit(train), moving[:6]


def test_ground_truth_the_copied_frame_and_a_reversed_clip(clips):
    analyser, moving = clips
    assert moving
    for frames, meta in moving:
        truth = judge(frames, frames, meta, analyser)
        assert truth["first_frame_psnr"] == 100.0 and truth["centroid_error_px"] == 0.0
        assert truth["direction_right"] == 1.0
        copied = judge(np.repeat(frames[:1], len(frames), axis=0), frames, meta, analyser)
        assert copied["first_frame_psnr"] == 100.0 and copied["direction_right"] == 0.0
        assert copied["centroid_error_px"] > 1.0 and copied["later_frames_psnr"] < truth["later_frames_psnr"]
        reversed_clip = judge(frames[::-1].copy(), frames, meta, analyser)
        assert reversed_clip["direction_right"] == 0.0 and reversed_clip["first_frame_psnr"] < 100.0


def test_psnr_of_known_errors():
    a = np.zeros((4, 4, 3), dtype=np.uint8)
    assert psnr(a, a) == 100.0
    assert psnr(a, a + 255) == pytest.approx(0.0)
    assert psnr(a, a + 1) == pytest.approx(20 * np.log10(255), abs=1e-9)
