"""Read a moving-shapes clip's attributes back from its pixels: the judge of the video DiT's prompt following.

Why it lives next to the builder and not in ``veomni/eval``: it knows this data set (one shape on a
plain dark background, the five caption attributes, sizes and speeds relative to min(H, W), stills
are 1-frame images), so it is no general video metric. It never sees a model: it is fitted only
on ground-truth frames of the *train* clips, and then judges any clip, generated or not.

- foreground: pixels far from the background colour (the median of the frame's border), at least
  half as far as the farthest pixel of the frame (so blurred edges of generated shapes count half-in);
- colour: mean RGB of the foreground; shape: fill ratio of the mask in its bounding box, where the
  mask's centroid sits in the box vertically, the box's aspect (the frame with the largest mask);
  size: sqrt(area of the mask's bounding box) / min(H, W), median over frames (the mask's own area
  would confuse a large triangle, half its box, with a small square);
- direction and speed: the median per-frame step of the foreground centroid; its angle picks the
  nearest train direction, its length / min(H, W) the nearest train speed. 1-frame clips are
  "still" (the caption format says so).

Each attribute is a nearest-centroid classifier on its features, scaled by the pooled within-class
spread, fitted on the train clips. A clip with no foreground gets ``NONE`` for every attribute.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

ATTRIBUTES = ("colour", "shape", "size", "direction", "speed")
STILL = "still"
NONE = "?"
MIN_CONTRAST = 30.0
"""Least distance (0-255 RGB) from the background a pixel needs to be foreground."""


@dataclass(frozen=True)
class ClipFeatures:
    colour: np.ndarray
    shape: np.ndarray
    size: np.ndarray
    step: np.ndarray | None
    """Median per-frame centroid step (dy, dx) / min(H, W); None for a 1-frame clip."""


def foreground(frame: np.ndarray) -> np.ndarray:
    """Boolean [H, W] mask of the pixels far from the frame's background colour (module docstring)."""
    pixels = frame.astype(np.float64)
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    distance = np.linalg.norm(pixels - np.median(border, axis=0), axis=-1)
    return distance >= max(MIN_CONTRAST, 0.5 * distance.max())


def _box(mask: np.ndarray) -> tuple[int, int, int, int]:
    """(top, left, height, width) of the mask's bounding box."""
    ys, xs = np.nonzero(mask)
    return ys.min(), xs.min(), ys.max() - ys.min() + 1, xs.max() - xs.min() + 1


def _shape_features(mask: np.ndarray) -> np.ndarray:
    top, _, height, width = _box(mask)
    ys = np.nonzero(mask)[0]
    return np.array([len(ys) / (height * width), (ys.mean() - top + 0.5) / height, width / height])


def clip_features(clip: np.ndarray) -> ClipFeatures | None:
    """Features of a uint8 [F, H, W, 3] clip; None when a frame has no foreground."""
    masks = [foreground(frame) for frame in clip]
    if not all(mask.any() for mask in masks):
        return None
    scale = min(clip.shape[1:3])
    colour = np.mean(np.concatenate([frame[mask] for frame, mask in zip(clip, masks)]), axis=0) / 255
    areas = np.array([mask.sum() for mask in masks])
    largest = masks[int(areas.argmax())]
    box_sides = np.array([np.sqrt(h * w) for *_, h, w in map(_box, masks)])
    centroids = np.array([np.argwhere(mask).mean(axis=0) for mask in masks])
    step = np.median(np.diff(centroids, axis=0), axis=0) / scale if len(clip) > 1 else None
    return ClipFeatures(colour, _shape_features(largest), np.array([np.median(box_sides) / scale]), step)


class NearestCentroid:
    """Label of the nearest class mean, each feature scaled by its pooled within-class deviation."""

    def fit(self, features: np.ndarray, labels: Sequence[str]) -> NearestCentroid:
        labels = np.asarray(labels)
        self.classes = sorted(set(labels.tolist()))
        self.means = np.stack([features[labels == c].mean(axis=0) for c in self.classes])
        spread = np.concatenate([features[labels == c] - m for c, m in zip(self.classes, self.means)])
        self.scale = np.maximum(spread.std(axis=0), 1e-6)
        return self

    def predict(self, feature: np.ndarray) -> str:
        distance = (((feature - self.means) / self.scale) ** 2).sum(axis=1)
        return self.classes[int(distance.argmin())]


class ShapesAnalyser:
    """Attributes of clips, from classifiers fitted on ground-truth train clips (module docstring)."""

    def fit(self, clips: Iterable[tuple[np.ndarray, dict]]) -> ShapesAnalyser:
        rows = [(features, meta) for clip, meta in clips if (features := clip_features(clip)) is not None]
        moving = [(f, m) for f, m in rows if f.step is not None and m["direction"] != STILL]
        if not moving:
            raise ValueError("fitting the analyser needs train clips with motion (more than one frame)")
        self.colour = NearestCentroid().fit(np.stack([f.colour for f, _ in rows]), [m["colour"] for _, m in rows])
        self.shape = NearestCentroid().fit(np.stack([f.shape for f, _ in rows]), [m["shape"] for _, m in rows])
        self.size = NearestCentroid().fit(np.stack([f.size for f, _ in rows]), [m["size"] for _, m in rows])
        speeds = np.array([[np.linalg.norm(f.step)] for f, _ in moving])
        self.speed = NearestCentroid().fit(speeds, [m["speed"] for _, m in moving])
        directions: dict[str, list[np.ndarray]] = {}
        for f, m in moving:
            directions.setdefault(m["direction"], []).append(f.step / max(np.linalg.norm(f.step), 1e-9))
        self.directions = {d: np.mean(v, axis=0) for d, v in directions.items()}
        return self

    def analyse(self, clip: np.ndarray) -> dict[str, str]:
        """The five attributes of a uint8 [F, H, W, 3] clip."""
        features = clip_features(clip)
        if features is None:
            return dict.fromkeys(ATTRIBUTES, NONE)
        found = {"colour": self.colour.predict(features.colour), "shape": self.shape.predict(features.shape),
                 "size": self.size.predict(features.size)}
        if features.step is None:
            return {**found, "direction": STILL, "speed": STILL}
        cosine = {d: float(features.step @ u) for d, u in self.directions.items()}
        return {**found, "direction": max(cosine, key=cosine.get),
                "speed": self.speed.predict(np.array([np.linalg.norm(features.step)]))}


def accuracy(found: Sequence[dict[str, str]], wanted: Sequence[dict]) -> dict[str, float]:
    """Per attribute (and ``all``: every attribute right), the fraction of clips whose attribute matches."""
    if len(found) != len(wanted) or not found:
        raise ValueError(f"need one wanted caption per analysed clip; got {len(found)} and {len(wanted)}")
    result = {a: float(np.mean([f[a] == w[a] for f, w in zip(found, wanted)])) for a in ATTRIBUTES}
    result["all"] = float(np.mean([all(f[a] == w[a] for a in ATTRIBUTES) for f, w in zip(found, wanted)]))
    return result


def shuffled(wanted: Sequence[dict], seed: int = 0) -> list[dict]:
    """``wanted`` in a seeded random order: the captions a clip that ignores its prompt would match."""
    order = list(wanted)
    random.Random(seed).shuffle(order)
    return order


def format_table(scores: dict[str, dict[str, float]]) -> str:
    """Rows = attributes, columns = the scored settings (e.g. model, shuffled captions, ground truth)."""
    names = list(scores)
    width = max(18, *(len(n) + 2 for n in names))
    lines = [f"{'attribute':<10}" + "".join(f"{n:>{width}}" for n in names)]
    for attribute in [*ATTRIBUTES, "all"]:
        lines.append(f"{attribute:<10}" + "".join(f"{scores[n][attribute]:>{width}.1%}" for n in names))
    return "\n".join(lines)
