"""The moving-shapes clip builder: captions that an independent reading of the pixels agrees with
(colour, shape, size, direction, speed), held-out combinations only in eval, shards that round-trip
through the engine's tar reader, deterministic and cached builds, and corrupt samples that the
clip decoder rejects."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from veomni.data.builders import load_script
from veomni.data.sources import ReadStats, iter_tar_samples
from veomni.data.video.clip_format import CorruptClipError, decode_clip

BUILDER = Path(__file__).resolve().parents[2] / "data" / "build_moving_shapes.py"
PRIMARIES = {"red": (1, 0, 0), "green": (0, 1, 0), "blue": (0, 0, 1), "yellow": (1, 1, 0), "white": (1, 1, 1),
             "magenta": (1, 0, 1)}
"""What the colour words mean, as RGB directions (not the builder's palette)."""
ADVERB_SPEED = {"slowly": "slow", "quickly": "fast"}


def build(root: Path, seed: int = 1234, train: int = 120, eval_: int = 40) -> None:
    load_script(BUILDER).build(root / "train", root / "eval", seed, train_samples=train, eval_samples=eval_)


def read_split(folder: Path) -> dict:
    """key -> Clip, read with the engine's tar reader (which must find nothing bad)."""
    stats = ReadStats()
    clips = [decode_clip(s) for s in iter_tar_samples(sorted(folder.glob("*.tar")), 0.0, stats)]
    assert stats.bad == 0
    return {clip.key: clip for clip in clips}


def observed_attributes(frames: np.ndarray) -> dict:
    """Colour, shape, size, direction and speed read from the pixels alone. The frames are
    anti-aliased, so each pixel's coverage is its distance from the background over the distance of
    a fully covered pixel; the shape's width is its widest row's coverage, its height its tallest
    column's, and its fill (area / (width x height)) tells square (1), circle (pi/4), triangle (1/2)."""
    count, height, width, _ = frames.shape
    values, counts = np.unique(frames[0].reshape(-1, 3), axis=0, return_counts=True)
    background = values[counts.argmax()].astype(float)  # the most common pixel
    distance = np.linalg.norm(frames - background, axis=-1)  # [F, H, W]
    full = np.unravel_index(distance.argmax(), distance.shape)
    coverage = distance / distance[full]
    areas = coverage.sum((1, 2))
    assert areas.min() > 0.95 * areas.max(), "the shape leaves the frame"
    rgb = frames[full].astype(float)
    colour = max(PRIMARIES, key=lambda name: rgb @ np.array(PRIMARIES[name]) / np.linalg.norm(PRIMARIES[name]))
    shape_w, shape_h = coverage[0].sum(1).max(), coverage[0].sum(0).max()
    fill = areas[0] / (shape_w * shape_h)
    shape = "square" if fill > 0.9 else "circle" if fill > 0.68 else "triangle"
    scale = min(height, width)
    size = "small" if max(shape_w, shape_h) < 0.3125 * scale else "large"
    result = {"colour": colour, "shape": shape, "size": size, "direction": "still", "speed": "still"}
    if count > 1:
        grid_y, grid_x = np.mgrid[:height, :width]
        centroid = np.stack([(coverage * grid).sum((1, 2)) / areas for grid in (grid_y, grid_x)], 1)
        velocity = (centroid[-1] - centroid[0]) / (count - 1)
        axis = int(np.abs(velocity).argmax())
        result["direction"] = [["up", "down"], ["left", "right"]][axis][int(velocity[axis] > 0)]
        assert abs(velocity[1 - axis]) < 0.05
        result["speed"] = "fast" if abs(velocity[axis]) * 32 / scale > 1.75 else "slow"
    return result


def caption_attributes(caption: str) -> dict:
    """Parse "a SIZE COLOUR SHAPE [moving DIRECTION ADVERB]"."""
    words = caption.split()
    assert words[0] == "a" and len(words) in (4, 7), caption
    parsed = dict(zip(("size", "colour", "shape"), words[1:4]), direction="still", speed="still")
    if len(words) == 7:
        assert words[4] == "moving", caption
        parsed.update(direction=words[5], speed=ADVERB_SPEED[words[6]])
    return parsed


def test_captions_match_pixels_and_eval_is_held_out(tmp_path) -> None:
    build(tmp_path)
    splits = {name: read_split(tmp_path / name) for name in ("train", "eval")}
    manifests = {name: json.loads((tmp_path / name / "manifest.json").read_text()) for name in splits}
    held_out = {tuple(combo) for combo in manifests["eval"]["held_out"]}
    stills = 0
    for name, clips in splits.items():
        assert len(clips) == manifests[name]["samples"] == sum(manifests[name]["captions"].values())
        for clip in clips.values():
            meta = clip.meta
            count, height, width, _ = clip.frames.shape
            assert {height, width} <= {32, 48} and count in ({1} if meta["direction"] == "still" else {5, 9})
            stills += count == 1
            attributes = {k: meta[k] for k in ("colour", "shape", "size", "direction", "speed")}
            assert caption_attributes(meta["caption"]) == attributes
            assert observed_attributes(clip.frames) == attributes, meta["caption"]
            assert ((meta["colour"], meta["shape"], meta["direction"]) in held_out) == (name == "eval")
            assert set(meta["caption"].split()) <= set(manifests[name]["vocabulary"])
    total = sum(len(clips) for clips in splits.values())
    assert 0.15 < stills / total < 0.45
    train_captions = {clip.meta["caption"] for clip in splits["train"].values()}
    assert not train_captions & {clip.meta["caption"] for clip in splits["eval"].values()}
    assert not set(splits["train"]) & set(splits["eval"])


def test_build_is_deterministic_cached_and_seeded(tmp_path) -> None:
    build(tmp_path / "a", train=30, eval_=10)
    build(tmp_path / "b", train=30, eval_=10)
    builder = load_script(BUILDER)
    first = read_split(tmp_path / "a" / "train")
    for key, clip in first.items():  # what the shards hold is what the generator made
        record, meta = builder.sample_record(int(key.split("_")[1]), 1234, held_out=False)
        assert clip.meta == meta and decode_clip(record).frames.tobytes() == clip.frames.tobytes()
    again = read_split(tmp_path / "b" / "train")
    assert all(again[k].frames.tobytes() == clip.frames.tobytes() for k, clip in first.items())
    result = subprocess.run([sys.executable, str(BUILDER), "--train-out", str(tmp_path / "a" / "train"),
                             "--eval-out", str(tmp_path / "a" / "eval"), "--train-samples", "30",
                             "--eval-samples", "10"], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.startswith("cached")
    build(tmp_path / "c", seed=7, train=30, eval_=10)
    other = read_split(tmp_path / "c" / "train")
    assert other.keys() == first.keys()
    assert sum(other[k].meta == first[k].meta for k in first) < len(first) // 2


def test_corrupt_shard_samples_are_rejected(tmp_path) -> None:
    build(tmp_path, train=10, eval_=5)
    keys = load_script(BUILDER).add_corrupt_shard(tmp_path / "train")
    assert json.loads((tmp_path / "train" / "manifest.json").read_text())["corrupt_samples"] == len(keys) == 3
    samples = list(iter_tar_samples(sorted((tmp_path / "train").glob("*.tar")), 1.0, ReadStats()))
    assert len(samples) == 13
    rejected = []
    for sample in samples:
        try:
            decode_clip(sample)
        except CorruptClipError as error:
            assert sample["__key__"] in str(error)
            rejected.append(sample["__key__"])
    assert rejected == keys


def test_decode_clip_names_what_is_wrong() -> None:
    record, _ = load_script(BUILDER).sample_record(3, 1234, held_out=False)
    with pytest.raises(CorruptClipError, match="no frames.npy"):
        decode_clip({"__key__": "k", "json": record["json"]})
    with pytest.raises(CorruptClipError, match="lacks"):
        decode_clip({**record, "json": b'{"caption": "a"}'})
