"""The prompt-following judge on clips whose attributes are known: ground-truth clips of the bundled
builder (data/build_moving_shapes.py) are read back almost perfectly, captions shuffled among them
score near chance, and a clip drawn in the wrong colour is scored wrong on colour alone."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from veomni.data.builders import load_script

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "data"))
from moving_shapes_analysis import ATTRIBUTES, NONE, ShapesAnalyser, accuracy, shuffled  # noqa: E402

BUILDER = load_script(REPO / "data" / "build_moving_shapes.py")


def _clips(first: int, count: int, held_out: bool) -> list[tuple[np.ndarray, dict]]:
    return [BUILDER.make_clip(np.random.default_rng([0, i]), held_out) for i in range(first, first + count)]


@pytest.fixture(scope="module")
def analyser() -> ShapesAnalyser:
    return ShapesAnalyser().fit(_clips(1000, 400, held_out=False))


@pytest.fixture(scope="module")
def held_out() -> list[tuple[np.ndarray, dict]]:
    return _clips(0, 120, held_out=True)


def test_ground_truth_held_out_clips_are_read_back(analyser, held_out):
    found = [analyser.analyse(clip) for clip, _ in held_out]
    scores = accuracy(found, [meta for _, meta in held_out])
    assert all(scores[a] >= 0.97 for a in ATTRIBUTES), scores
    assert scores["all"] >= 0.95, scores


def test_captions_shuffled_among_the_clips_score_near_chance(analyser, held_out):
    found = [analyser.analyse(clip) for clip, _ in held_out]
    wanted = [meta for _, meta in held_out]
    scores = accuracy(found, shuffled(wanted, seed=1))
    # Chance is the match rate of two independent draws from the held-out attribute frequencies.
    for attribute in ATTRIBUTES:
        values = [meta[attribute] for meta in wanted]
        chance = sum((values.count(v) / len(values)) ** 2 for v in set(values))
        assert abs(scores[attribute] - chance) < 0.15, (attribute, scores[attribute], chance)
    assert scores["all"] < 0.2


def test_a_clip_in_the_wrong_colour_is_scored_wrong_on_colour_only(analyser):
    clip, meta = next((c, m) for c, m in _clips(5000, 50, held_out=False) if m["colour"] == "red")
    blue = clip[..., ::-1]  # red (230, 40, 40) -> (40, 40, 230), the grey background unchanged
    found = analyser.analyse(blue)
    assert found["colour"] == "blue"
    scores = accuracy([found], [meta])
    assert scores["colour"] == 0.0 and all(scores[a] == 1.0 for a in ATTRIBUTES if a != "colour")


def test_an_empty_clip_matches_nothing(analyser):
    found = analyser.analyse(np.full((5, 32, 32, 3), 20, np.uint8))
    assert found == dict.fromkeys(ATTRIBUTES, NONE)
