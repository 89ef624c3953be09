"""Build the bundled video question-answering set: one moving shape per clip, and questions of which
the main one (which way does it move?) can only be answered from the order of the frames.

Why this set: it is generated offline (no download) and builds in seconds, small enough for the tiny
Qwen2.5-VL video recipe (``recipes/qwen2.5-vl/tiny_video.yaml``) to learn on a CPU in minutes, and
it sends videos through the whole path a real video run takes: ``<key>.video.npz`` chat members,
Qwen's frame sampling, 2-frame temporal patches, ``<|video_pad|>`` tokens and M-RoPE time
positions from ``second_per_grid_ts``. Only the order of the frames tells the direction: one frame
hints at it at most (a clip starts where its whole path fits, so a shape near the left edge is
seldom moving left), and the frames as an unordered set tell the axis but not which way along
it (a path and its reverse pass through the same places). Held-out direction accuracy far above
the majority baseline shows the model reads the time dimension; colour and shape, readable from
any frame, are the easy controls.

The clips are the text-to-video set's moving shapes (``render_clip`` of
``data/build_moving_shapes.py``: one anti-aliased shape of six colours and three shapes, small or
large, moving quickly (``SPEED``) left, right, up or down on a dark plain background, always
wholly inside the frame), here ``FRAMES`` frames of ``SIDE`` x ``SIDE`` px at ``FPS`` frames per second.
At Qwen's sampling rate of 2 frames per second every frame reaches the model: 4 temporal patches of
2 frames, 1 s each. One question per clip (half of them the direction), answered with one word:

    direction  "Which way does the shape move?"  left|right|up|down
    color      "What color is the shape?"        red|green|blue|yellow|white|magenta
    shape      "What shape is it?"               circle|square|triangle

Output: webdataset tar shards in ``--train-out`` and ``--eval-out``; each sample is ``{"__key__",
"video.npz": the frames and their fps (models/omni/qwen_video.py's member), "json": {"messages":
[...], "question_type": ...}}`` (the chat format of docs/data.md). ``manifest.json`` is written
last and records ``FORMAT_VERSION``, the clip format and, per question type, the answer counts; the
eval manifest also the majority-class baseline. Each sample is drawn from its own RNG seeded by
``(seed, index)``; eval holds samples ``0 ..``, train the ones after. Staged, then renamed into place,
under a file lock (``veomni/data/builders.py``).

    python data/build_video_qa.py --train-out data/cache/video_qa/train --eval-out data/cache/video_qa/eval
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from build_moving_shapes import DIRECTIONS, PALETTE, SHAPES, SIZE_FRACTION, render_clip  # noqa: E402

from models.omni.qwen_video import encode_video_member  # noqa: E402
from veomni.data.builders import (  # noqa: E402
    builder_main,
    majority_baseline,
    record_baseline,
    write_answered_split,
    write_generated_splits,
)

FORMAT_VERSION = 1
TRAIN_SAMPLES = 6000
EVAL_SAMPLES = 600
SAMPLES_PER_SHARD = 2000
FRAMES, SIDE, FPS = 8, 56, 2.0
"""8 frames at 2 fps: a 4 s clip that Qwen's 2-fps sampling keeps whole. 56 px is 2 x 2 merged
tokens a frame, so a clip is 4 x 4 = 16 ``<|video_pad|>`` tokens and 64 patches of 2 frames."""
QUESTIONS = {
    "direction": "Which way does the shape move?",
    "color": "What color is the shape?",
    "shape": "What shape is it?",
}
QUESTION_TYPES = tuple(QUESTIONS)
QUESTION_SHARE = (0.5, 0.25, 0.25)
"""Half the questions ask the direction, the one that needs the time dimension and takes longest to learn."""
SPEED = "fast"
"""The moving-shapes set's fast speed: 4.4 px a frame at 56 px, 31 px over the clip, so the shape crosses
from one merged token (28 px) into the next; at the slow speed it moves 12 px over the clip."""


def _pick(rng: np.random.Generator, options) -> str:
    options = list(options)
    return options[rng.integers(len(options))]


def make_sample(rng: np.random.Generator) -> tuple[np.ndarray, str, str]:
    """``(frames uint8 [FRAMES, SIDE, SIDE, 3], question_type, answer)`` of one random sample."""
    colour, shape, direction = _pick(rng, PALETTE), _pick(rng, SHAPES), _pick(rng, DIRECTIONS)
    frames, _ = render_clip(rng, colour, shape, _pick(rng, SIZE_FRACTION), direction, SPEED, FRAMES, SIDE, SIDE)
    qtype = QUESTION_TYPES[rng.choice(len(QUESTION_TYPES), p=QUESTION_SHARE)]
    return frames, qtype, {"direction": direction, "color": colour, "shape": shape}[qtype]


def sample_record(index: int, seed: int) -> tuple[dict, str, str]:
    frames, qtype, answer = make_sample(np.random.default_rng([seed, index]))
    meta = {
        "messages": [
            {"role": "user", "content": f"<video>\n{QUESTIONS[qtype]}"},
            {"role": "assistant", "content": answer},
        ],
        "question_type": qtype,
    }
    record = {"__key__": f"videoqa_{index:07d}", "video.npz": encode_video_member(frames, FPS),
              "json": json.dumps(meta).encode()}
    return record, qtype, answer


def write_split(out: Path, first_index: int, count: int, seed: int) -> dict[str, Counter]:
    """Write samples ``first_index ..`` into ``out`` (staged, then renamed); answer counts by type."""
    records = (sample_record(index, seed) for index in range(first_index, first_index + count))
    return write_answered_split(out, records, QUESTION_TYPES, SAMPLES_PER_SHARD, {
        "format_version": FORMAT_VERSION, "seed": seed, "first_index": first_index,
        "clip": {"frames": FRAMES, "height": SIDE, "width": SIDE, "fps": FPS}})


def build(train_out: Path, eval_out: Path, seed: int, train_samples: int, eval_samples: int) -> None:
    train, held_out = write_generated_splits(train_out, eval_out, train_samples, eval_samples,
                                             lambda out, first, count: write_split(out, first, count, seed),
                                             unit="clips")
    record_baseline(eval_out, majority_baseline(train, held_out), "answer",
                    "majority-class baseline on the held-out split:")


def main() -> None:
    builder_main(__doc__, FORMAT_VERSION, build, sample_counts=(TRAIN_SAMPLES, EVAL_SAMPLES))


if __name__ == "__main__":
    main()
