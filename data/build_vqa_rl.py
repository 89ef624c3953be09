"""Build the bundled visual RL prompts: visual QA questions on new pictures, the answer hidden, for
GRPO on the tiny Qwen2.5-VL (``recipes/rl/tiny_vqa_grpo.yaml``, ``data.kind: chat_media_prompts``).

Why this set: the VQA SFT model (``recipes/qwen2.5-vl/tiny.yaml``) answers the visual QA set's
questions well but not perfectly (about 79% held out), so an exact-match reward on new questions of
the same kind has something to raise, and greedy held-out exact match (``bash scripts/eval_vqa.sh``)
measures it. Each record is a new picture of ``data/build_vqa.py``'s kind (its generator under
another seed: no image is one the SFT run saw) and its question, in the ``chat_media`` format
(docs/data.md): the ``png`` member and ``json`` ``{"messages": [user "<image>\\n<question>",
assistant "<answer>"], "question_type": ...}``, whose last assistant turn is the hidden answer.

    python data/build_vqa_rl.py --train-out data/cache/vqa_rl/train --eval-out data/cache/vqa_rl/eval
"""

from __future__ import annotations

import random
from pathlib import Path

from veomni.data.builders import builder_main, sibling_builder, write_answered_split, write_generated_splits

FORMAT_VERSION = 1
TRAIN_SAMPLES = 2_000
EVAL_SAMPLES = 400
SAMPLES_PER_SHARD = 4_000


VQA = sibling_builder(__file__, "build_vqa")  # the builder whose generator these samples share


def write_split(out: Path, first_index: int, count: int, seed: int) -> dict:
    rng = random.Random(f"{seed}:rl:{out.name}")  # not the SFT set's pictures, nor the preference pairs'
    records = (VQA.sample_record(index, rng) for index in range(first_index, first_index + count))
    return write_answered_split(out, records, VQA.QUESTION_TYPES, SAMPLES_PER_SHARD,
                                {"format_version": FORMAT_VERSION, "seed": seed})


def build(train_out: Path, eval_out: Path, seed: int, train_samples: int, eval_samples: int) -> None:
    write_generated_splits(train_out, eval_out, train_samples, eval_samples,
                           lambda out, first, n: write_split(out, first, n, seed), unit="prompts")


def main() -> None:
    builder_main(__doc__, FORMAT_VERSION, build, sample_counts=(TRAIN_SAMPLES, EVAL_SAMPLES))


if __name__ == "__main__":
    main()
