"""Build the bundled visual question-answering set: answers can only be read from the picture.

Why this set: it is generated offline (no download), small enough for a tiny ViT + LLM to learn
on a CPU in minutes, and every answer depends on the image, so held-out accuracy far above the
majority-class baseline shows the encoder, the adapter and the splicing all work.

Each image (``56..140`` px per side, varying aspect ratio, light noisy background, a thin dark
frame marking its edges) holds shapes
(circle, square, triangle, cross) in colours (red, green, blue, yellow, purple). One question
per image, of one of five types, answered with one word:

    color     "What color is the shape?"               one shape        red|green|blue|yellow|purple
    shape     "What shape is it?"                      one shape        circle|square|triangle|cross
    count     "How many shapes are there?"             1..4 shapes      one|two|three|four
    position  "Is the shape on the left or the right?" one shape        left|right
    size      "Is the shape big or small?"             one shape        big|small

Output: webdataset tar shards in ``--train-out`` and ``--eval-out``; each sample is
``{"__key__", "png": image bytes, "json": {"messages": [...], "question_type": ...}}`` (the chat
format of docs/data.md). ``manifest.json`` is written last and records ``FORMAT_VERSION`` and,
per question type, the answer counts and the majority-class baseline (the held-out accuracy
of always giving the most common training answer). Splits are written to a temporary sibling
folder and renamed into place; a file lock lets concurrent launchers wait for one builder.

    python data/build_vqa.py --train-out data/cache/vqa/train --eval-out data/cache/vqa/eval
"""

from __future__ import annotations

import io
import json
import random
from collections import Counter
from pathlib import Path

from PIL import Image, ImageDraw

from veomni.data.builders import (
    builder_main,
    majority_baseline,
    record_baseline,
    write_answered_split,
    write_generated_splits,
)

FORMAT_VERSION = 3  # 3: shard_records (records per shard, what a damaged shard lost; publish_split writes it)
TRAIN_SAMPLES = 24_000
EVAL_SAMPLES = 1_000
SAMPLES_PER_SHARD = 4_000
MIN_SIDE, MAX_SIDE = 56, 140

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (230, 200, 30),
    "purple": (140, 50, 180),
}
SHAPES = ("circle", "square", "triangle", "cross")
COUNT_WORDS = ("one", "two", "three", "four")
QUESTIONS = {
    "color": "What color is the shape?",
    "shape": "What shape is it?",
    "count": "How many shapes are there?",
    "position": "Is the shape on the left or the right?",
    "size": "Is the shape big or small?",
}
QUESTION_TYPES = tuple(QUESTIONS)


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], color: tuple) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=color)
    else:  # cross: two bars a third of the box wide
        w, h = (x1 - x0) / 3, (y1 - y0) / 3
        draw.rectangle((x0, y0 + h, x1, y1 - h), fill=color)
        draw.rectangle((x0 + w, y0, x1 - w, y1), fill=color)


def _free_box(rng: random.Random, width: int, height: int, size: int, taken: list, x_range: tuple[int, int]):
    """A ``size`` square box inside the image and ``x_range``, apart from ``taken``; None if none fits."""
    for _ in range(50):
        x0 = rng.randint(x_range[0], max(x_range[0], x_range[1] - size))
        y0 = rng.randint(2, max(2, height - size - 2))
        box = (x0, y0, x0 + size, y0 + size)
        if box[2] <= width - 2 and all(
            box[2] + 3 < t[0] or t[2] + 3 < box[0] or box[3] + 3 < t[1] or t[3] + 3 < box[1] for t in taken
        ):
            return box
    return None


def make_sample(rng: random.Random) -> tuple[Image.Image, str, str]:
    """``(image, question_type, answer)`` for one random sample."""
    width, height = rng.randint(MIN_SIDE, MAX_SIDE), rng.randint(MIN_SIDE, MAX_SIDE)
    background = tuple(rng.randint(225, 255) for _ in range(3))
    image = Image.new("RGB", (width, height), background)
    draw = ImageDraw.Draw(image)
    for _ in range(width * height // 60):  # sparse noise so the background is not trivially flat
        draw.point(
            (rng.randrange(width), rng.randrange(height)), fill=tuple(rng.randint(180, 255) for _ in range(3))
        )
    # A thin dark frame marks the image's edges: the ViT has only relative (2D RoPE) positions,
    # so "left" and "right" are read against the edges, as a person reads them.
    draw.rectangle((0, 0, width - 1, height - 1), outline=(60, 60, 60), width=2)
    qtype = rng.choice(QUESTION_TYPES)
    short = min(width, height)
    if qtype == "count":
        count = rng.randint(1, 4)
        taken: list = []
        size = max(14, short // 4)
        while len(taken) < count:
            box = _free_box(rng, width, height, size, taken, (2, width - 2))
            if box is None:  # crowded: start over with smaller shapes
                taken, size = [], max(10, size - 2)
                continue
            taken.append(box)
        for box in taken:
            draw_shape(draw, rng.choice(SHAPES), box, COLORS[rng.choice(list(COLORS))])
        return image, qtype, COUNT_WORDS[count - 1]
    big = rng.random() < 0.5
    size = int(short * (rng.uniform(0.55, 0.75) if big else rng.uniform(0.25, 0.35)))
    side = rng.choice(("left", "right"))
    if qtype == "position":  # the shape lies wholly in its half
        size = min(size, width // 2 - 6)
        x_range = (2, width // 2 - 2) if side == "left" else (width // 2 + 2, width - 2)
    else:
        x_range = (2, width - 2)
    box = _free_box(rng, width, height, size, [], x_range)
    shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
    draw_shape(draw, shape, box, COLORS[color])
    answer = {"color": color, "shape": shape, "position": side, "size": "big" if big else "small"}[qtype]
    return image, qtype, answer


def sample_record(index: int, rng: random.Random) -> tuple[dict, str, str]:
    image, qtype, answer = make_sample(rng)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    meta = {
        "messages": [
            {"role": "user", "content": f"<image>\n{QUESTIONS[qtype]}"},
            {"role": "assistant", "content": answer},
        ],
        "question_type": qtype,
    }
    record = {"__key__": f"vqa_{index:07d}", "png": buffer.getvalue(), "json": json.dumps(meta).encode()}
    return record, qtype, answer


def write_split(out: Path, first_index: int, count: int, seed: int) -> dict[str, Counter]:
    """Write ``count`` samples to a temporary folder, then rename it to ``out``; answer counts by type."""
    rng = random.Random(f"{seed}:{out.name}")
    records = (sample_record(index, rng) for index in range(first_index, first_index + count))
    return write_answered_split(out, records, QUESTION_TYPES, SAMPLES_PER_SHARD,
                                {"format_version": FORMAT_VERSION, "seed": seed})


def build(train_out: Path, eval_out: Path, seed: int, train_samples: int, eval_samples: int) -> None:
    train, held_out = write_generated_splits(
        train_out, eval_out, train_samples, eval_samples, lambda out, first, count: write_split(out, first, count, seed)
    )
    record_baseline(eval_out, majority_baseline(train, held_out), "answer",
                    "majority-class baseline on the held-out split:")


def main() -> None:
    builder_main(__doc__, FORMAT_VERSION, build, sample_counts=(TRAIN_SAMPLES, EVAL_SAMPLES))


if __name__ == "__main__":
    main()
