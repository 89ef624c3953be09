"""Build the bundled visual preference pairs: visual QA prompts with a preferred answer form the VQA
SFT data never shows, so a preference objective on a VLM has something to teach that SFT did not.

Why this set: the tiny VLMs trained on the bundled visual QA set (``recipes/qwen2.5-vl/tiny.yaml``)
answer with the bare lower-case word of their data ("red", "left", "two"), the only form it holds.
Each pair here is a new picture of the same kind (``data/build_vqa.py``'s generator under another
seed, so no image is one the SFT run saw) with its question, and two replies with the same, correct
answer: chosen written as a sentence's word, capitalised with a full stop ("Red."), rejected in the
SFT form ("red"). A model that learns the preference answers in the new form and stays right:
greedy exact match against the chosen reply (``bash scripts/eval_vqa.sh``) measures both at once,
and the SFT model starts at 0% on it.

Each record is a webdataset sample: the picture (``png``) and the pair (``json``, TRL's
conversational preference format with the ``<image>`` marker in the prompt, docs/data.md
"Preference pairs with images and videos")::

    prompt    [user "<image>\\nWhat color is the shape?"]
    chosen    [assistant "Red."]
    rejected  [assistant "red"]
    question_type  "color"

    python data/build_vqa_preference.py --train-out data/cache/vqa_preference/train \\
        --eval-out data/cache/vqa_preference/eval
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from veomni.data.builders import builder_main, sibling_builder, write_answered_split, write_generated_splits

FORMAT_VERSION = 1
TRAIN_SAMPLES = 2_000
EVAL_SAMPLES = 200
SAMPLES_PER_SHARD = 4_000


VQA = sibling_builder(__file__, "build_vqa")  # the builder whose generator these samples share


def preferred(answer: str) -> str:
    """The answer form the pairs prefer: capitalised, with a full stop."""
    return answer.capitalize() + "."


def pair_record(index: int, rng: random.Random) -> tuple[dict, str, str]:
    """``(webdataset record, question type, chosen answer)`` from one visual QA sample."""
    record, qtype, answer = VQA.sample_record(index, rng)
    messages = json.loads(record["json"])["messages"]
    pair = {"prompt": messages[:-1], "chosen": [{"role": "assistant", "content": preferred(answer)}],
            "rejected": [{"role": "assistant", "content": answer}], "question_type": qtype}
    return {"__key__": f"vqa_pair_{index:07d}", "png": record["png"], "json": json.dumps(pair).encode()}, qtype, \
        preferred(answer)


def write_split(out: Path, first_index: int, count: int, seed: int) -> dict:
    rng = random.Random(f"{seed}:preference:{out.name}")  # not the SFT set's pictures

    def records() -> Iterator[tuple[dict, str, str]]:
        for index in range(first_index, first_index + count):
            yield pair_record(index, rng)

    return write_answered_split(out, records(), VQA.QUESTION_TYPES, SAMPLES_PER_SHARD,
                                {"format_version": FORMAT_VERSION, "seed": seed})


def build(train_out: Path, eval_out: Path, seed: int, train_samples: int, eval_samples: int) -> None:
    write_generated_splits(train_out, eval_out, train_samples, eval_samples,
                           lambda out, first, n: write_split(out, first, n, seed), unit="pairs")


def main() -> None:
    builder_main(__doc__, FORMAT_VERSION, build, sample_counts=(TRAIN_SAMPLES, EVAL_SAMPLES))


if __name__ == "__main__":
    main()
