"""Build the bundled captioned-clip set for the video DiT: one coloured shape moving on a plain dark
background, with a caption that says what moves where and how fast.

Why this set: it is generated offline (no download), tiny enough for a small VAE and DiT to learn
on one machine, and every caption word is visible in the pixels, so a prompt-following metric can
check a generated clip against its prompt (colour, shape, size, direction, speed). The eval split
holds only attribute combinations that training never shows, so following its prompts needs
composition, not memory.

A sample is drawn from its own RNG seeded by ``(seed, index)``:

- resolution H, W each in {32, 48} (non-square allowed); ~30% are still images (1 frame,
  direction and speed "still"), the others clips of 5 or 9 frames;
- colour (``PALETTE``), shape (circle, square, triangle: apex up), size (bounding box
  ``SIZE_FRACTION`` x min(H, W)), anti-aliased, on a background of one grey level in [0, 40];
- motion: the shape's centre moves by a constant offset per frame, ``SPEED_PX_AT_32`` px for a
  32-px frame (scaled by min(H, W) / 32) toward left, right, up or down, starting where the whole
  shape stays inside the frame in every frame (no wrapping: the centroid moves in a straight line);
- caption ``"a small red circle moving left slowly"``, images ``"a large blue square"``.

Held out: the (colour, shape, direction) triples of ``HELD_OUT`` (direction "still" = images)
never occur in train; eval holds only them. Output (format of veomni/data/video/clip_format.py) per
split: webdataset shards of ``__key__``, ``frames.npy`` (uint8 [F, H, W, 3]) and ``json`` (the
attributes, caption, ``frames``/``height``/``width``, and for the metric ``start_yx`` (the
centre in frame 0, pixels), ``step_yx`` (its offset per frame) and ``extent`` (bounding box side,
pixels)); ``manifest.json`` written last with ``format_version``, ``attributes``, ``held_out``,
``palette``, ``vocabulary`` (every word a caption can use) and counts per caption and shape.
``add_corrupt_shard`` appends damaged samples to a built split, for readers' tests.

    python data/build_moving_shapes.py --train-out data/cache/video/moving_shapes/train \\
        --eval-out data/cache/video/moving_shapes/eval
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import webdataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from veomni.data.builders import (  # noqa: E402
    add_to_manifest,
    builder_main,
    publish_split,
    staging_folder,
    write_generated_splits,
)
from veomni.data.video.clip_format import FRAMES_MEMBER, JSON_MEMBER, encode_frames  # noqa: E402

FORMAT_VERSION = 2  # 2: shard_records (records per shard, what a damaged shard lost; publish_split writes it)
TRAIN_SAMPLES = 4000
EVAL_SAMPLES = 200
SAMPLES_PER_SHARD = 1000
PALETTE = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 240),
           "yellow": (235, 220, 40), "white": (240, 240, 240), "magenta": (220, 50, 220)}
SHAPES = ("circle", "square", "triangle")
SIZE_FRACTION = {"small": 0.25, "large": 0.375}
"""Bounding-box side / min(H, W). The largest shape at the fastest speed over 9 frames just fits
a 32-px side: 0.375 + 8 * 2.5 / 32 = 1."""
DIRECTIONS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
"""Unit (dy, dx) per direction; y grows downward."""
SPEED_PX_AT_32 = {"slow": 1.0, "fast": 2.5}
ADVERBS = {"slow": "slowly", "fast": "quickly"}
STILL = "still"
STILL_FRACTION = 0.3
SIDES = (32, 48)
CLIP_FRAMES = (5, 9)
BACKGROUND_MAX = 40
SUPERSAMPLE = 4
"""Edge pixels take the shape's coverage of a 4 x 4 grid of points (anti-aliasing): a shape's area
and centroid then move smoothly with sub-pixel positions instead of jumping a pixel row at a time."""
HELD_OUT = (
    ("red", "triangle", "left"), ("green", "circle", "right"), ("blue", "square", "up"),
    ("yellow", "triangle", "down"), ("white", "circle", "left"), ("magenta", "square", "right"),
    ("red", "circle", STILL), ("yellow", "square", STILL), ("magenta", "triangle", STILL),
)
"""(colour, shape, direction) triples only eval has: every colour, shape and direction appears."""
ATTRIBUTES = {"colour": list(PALETTE), "shape": list(SHAPES), "size": list(SIZE_FRACTION),
              "direction": [*DIRECTIONS, STILL], "speed": [*SPEED_PX_AT_32, STILL]}


def caption_of(colour: str, shape: str, size: str, direction: str, speed: str) -> str:
    if direction == STILL:
        return f"a {size} {colour} {shape}"
    return f"a {size} {colour} {shape} moving {direction} {ADVERBS[speed]}"


def vocabulary() -> list[str]:
    """Every word any caption can use, sorted."""
    words = {"a", "moving", *PALETTE, *SHAPES, *SIZE_FRACTION, *DIRECTIONS, *ADVERBS.values()}
    return sorted(words)


def draw_attributes(rng: np.random.Generator, held_out: bool) -> tuple[str, str, str]:
    """(colour, shape, direction): from ``HELD_OUT`` for eval, from everything else for train."""
    still = rng.random() < STILL_FRACTION
    if held_out:
        combos = [combo for combo in HELD_OUT if (combo[2] == STILL) == still]
        return combos[rng.integers(len(combos))]
    directions = [STILL] if still else list(DIRECTIONS)
    while True:
        combo = (list(PALETTE)[rng.integers(len(PALETTE))], SHAPES[rng.integers(len(SHAPES))],
                 directions[rng.integers(len(directions))])
        if combo not in HELD_OUT:
            return combo


def shape_mask(shape: str, dy: np.ndarray, dx: np.ndarray, extent: float) -> np.ndarray:
    """Pixels whose centre lies inside the shape; (dy, dx) are offsets from its bounding-box centre."""
    half = extent / 2
    if shape == "circle":
        return dy ** 2 + dx ** 2 <= half ** 2
    if shape == "square":
        return (np.abs(dy) <= half) & (np.abs(dx) <= half)
    return (dy >= -half) & (dy <= half) & (np.abs(dx) <= (dy + half) / 2)


def make_clip(rng: np.random.Generator, held_out: bool) -> tuple[np.ndarray, dict]:
    """One sample: uint8 frames [F, H, W, 3] and its json (module docstring)."""
    colour, shape, direction = draw_attributes(rng, held_out)
    size = list(SIZE_FRACTION)[rng.integers(len(SIZE_FRACTION))]
    height, width = (int(side) for side in rng.choice(SIDES, size=2))
    still = direction == STILL
    speed = STILL if still else list(SPEED_PX_AT_32)[rng.integers(len(SPEED_PX_AT_32))]
    frames = 1 if still else int(rng.choice(CLIP_FRAMES))
    return render_clip(rng, colour, shape, size, direction, speed, frames, height, width)


def render_clip(rng: np.random.Generator, colour: str, shape: str, size: str, direction: str, speed: str,
                frames: int, height: int, width: int) -> tuple[np.ndarray, dict]:
    """The frames [F, H, W, 3] and json of a clip with these attributes (``STILL`` direction and speed
    for an image); its start and background grey are drawn from ``rng``. Other sets of moving shapes
    (the video QA set) pick their own attributes, frame counts and sizes and draw through it."""
    still = direction == STILL
    scale = min(height, width)
    extent = SIZE_FRACTION[size] * scale
    pixels_per_frame = 0.0 if still else SPEED_PX_AT_32[speed] * scale / 32
    step = np.zeros(2) if still else np.array(DIRECTIONS[direction], dtype=np.float64) * pixels_per_frame
    travel = step * (frames - 1)
    low = extent / 2 - np.minimum(travel, 0)
    high = np.array([height, width]) - extent / 2 - np.maximum(travel, 0)
    start = low + rng.random(2) * (high - low)
    centres = start[None, :] + np.arange(frames)[:, None] * step[None, :]  # [F, 2]
    sub = (np.arange(SUPERSAMPLE) + 0.5) / SUPERSAMPLE
    dy = (np.arange(height)[:, None] + sub).reshape(-1)[None, :, None] - centres[:, 0, None, None]
    dx = (np.arange(width)[:, None] + sub).reshape(-1)[None, None, :] - centres[:, 1, None, None]
    inside = shape_mask(shape, dy, dx, extent)  # [F, H * S, W * S]
    coverage = inside.reshape(frames, height, SUPERSAMPLE, width, SUPERSAMPLE).mean((2, 4))[..., None]
    background = float(rng.integers(BACKGROUND_MAX + 1))
    pixels = np.rint(background + coverage * (np.array(PALETTE[colour], dtype=np.float64) - background))
    meta = {"caption": caption_of(colour, shape, size, direction, speed), "colour": colour, "shape": shape,
            "size": size, "direction": direction, "speed": speed, "frames": frames, "height": height,
            "width": width, "start_yx": [round(float(v), 4) for v in start],
            "step_yx": [round(float(v), 4) for v in step], "extent": round(extent, 4)}
    return pixels.astype(np.uint8), meta


def sample_record(index: int, seed: int, held_out: bool) -> tuple[dict, dict]:
    """The webdataset record of sample ``index`` and its json."""
    frames, meta = make_clip(np.random.default_rng([seed, index]), held_out)
    record = {"__key__": f"clip_{index:07d}", FRAMES_MEMBER: encode_frames(frames),
              JSON_MEMBER: json.dumps(meta).encode()}
    return record, meta


def write_split(out: Path, first_index: int, count: int, seed: int, held_out: bool) -> dict[str, Counter]:
    """Write samples ``first_index ..`` into ``out`` (staged, then renamed); returns caption counts."""
    tmp = staging_folder(out)
    captions: Counter = Counter()
    shapes: Counter = Counter()
    with webdataset.ShardWriter(str(tmp / "shard-%06d.tar"), maxcount=SAMPLES_PER_SHARD, verbose=0) as writer:
        for index in range(first_index, first_index + count):
            record, meta = sample_record(index, seed, held_out)
            writer.write(record)
            captions[meta["caption"]] += 1
            shapes[f"{meta['frames']}x{meta['height']}x{meta['width']}"] += 1
    manifest = {
        "samples": count,
        "format_version": FORMAT_VERSION,
        "seed": seed,
        "first_index": first_index,
        "split": "eval (held-out combinations only)" if held_out else "train",
        "shards": len(list(tmp.glob("*.tar"))),
        "attributes": ATTRIBUTES,
        "held_out": [list(combo) for combo in HELD_OUT],
        "palette": {name: list(rgb) for name, rgb in PALETTE.items()},
        "size_fraction": SIZE_FRACTION,
        "speed_px_per_frame_at_32": SPEED_PX_AT_32,
        "motion": "constant offset per frame (step_yx), the whole shape inside the frame in every frame; no wrap",
        "vocabulary": vocabulary(),
        "shapes": dict(sorted(shapes.items())),
        "captions": dict(sorted(captions.items())),
    }
    publish_split(tmp, out, manifest)
    return {"caption": captions}


def add_corrupt_shard(split: Path) -> list[str]:
    """Append a shard of three damaged samples (truncated ``frames.npy``, frames whose shape
    contradicts the json, unparsable json) to the built ``split``; the manifest records them as
    ``corrupt_samples``. Returns their keys. For tests of readers, which must skip and count them."""
    record, meta = sample_record(0, seed=0, held_out=False)
    wrong_shape = encode_frames(np.zeros((meta["frames"], meta["height"], meta["width"] + 1, 3), np.uint8))
    damaged = [
        {**record, "__key__": "corrupt_truncated_npy", FRAMES_MEMBER: record[FRAMES_MEMBER][:100]},
        {**record, "__key__": "corrupt_wrong_shape", FRAMES_MEMBER: wrong_shape},
        {**record, "__key__": "corrupt_bad_json", JSON_MEMBER: b'{"caption": "a small'},
    ]
    with webdataset.TarWriter(str(split / "shard-corrupt.tar")) as writer:
        for sample in damaged:
            writer.write(sample)
    add_to_manifest(split, corrupt_samples=len(damaged))
    return [sample["__key__"] for sample in damaged]


def build(train_out: Path, eval_out: Path, seed: int, train_samples: int, eval_samples: int) -> None:
    write_generated_splits(
        train_out, eval_out, train_samples, eval_samples,
        lambda out, first, count: write_split(out, first, count, seed, held_out=out == eval_out), unit="clips",
    )


def main() -> None:
    builder_main(__doc__, FORMAT_VERSION, build, sample_counts=(TRAIN_SAMPLES, EVAL_SAMPLES))


if __name__ == "__main__":
    main()
