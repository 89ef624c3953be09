"""Build the bundled preference pairs: the chat SFT set's prompts, with a preferred answer form the
SFT data never shows, so a preference objective has something to teach that SFT did not.

Why this set: the chat SFT model (``recipes/chat/tiny_chat_sft.yaml``) answers "reverse" and "sort"
prompts with the digits separated by spaces ("4 9 2 7"), the only form its data holds. Each pair
here has the same kind of prompt (system + user, sometimes an earlier exchange) and two replies
with the same, correct digits: chosen comma-separated ("4, 9, 2, 7"), rejected space-separated (the
SFT form). A model that learns the preference answers in the new form, and stays right: greedy
exact match against the chosen reply (``bash scripts/eval_chat.sh``) measures both at once, and the
SFT model starts near 0% on it.

Each record (``json`` member of a webdataset sample, TRL's conversational preference format,
docs/data.md "Preference pairs")::

    prompt    [system "Sort the digits in ascending order.", user "7 2 9 4"]
    chosen    [assistant "2, 4, 7, 9"]
    rejected  [assistant "2 4 7 9"]

Output: ``--train-out`` and ``--eval-out`` splits (shards + ``manifest.json``) and the chat tokenizer
beside them (``<train-out>/../tokenizer``, the same as the chat SFT set's).

    python data/build_chat_preference.py --train-out data/cache/chat_preference/train \\
        --eval-out data/cache/chat_preference/eval
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from veomni.data.builders import sibling_builder, write_answered_split, write_generated_splits

FORMAT_VERSION = 1
TRAIN_SAMPLES = 4_000
EVAL_SAMPLES = 300
SAMPLES_PER_SHARD = 10_000


CHAT_SFT = sibling_builder(__file__, "build_chat_sft")  # the builder whose generator these samples share


def preferred(answer: str) -> str:
    """The answer form the pairs prefer: the same digits, comma-separated."""
    return ", ".join(answer.split())


def make_pair(rng: random.Random) -> tuple[dict, str, str]:
    """``(pair, task, chosen answer)`` from one chat SFT conversation."""
    conversation, task, _, answer = CHAT_SFT.make_conversation(rng)
    prompt = conversation["messages"][:-1]
    pair = {"prompt": prompt, "chosen": [{"role": "assistant", "content": preferred(answer)}],
            "rejected": [{"role": "assistant", "content": answer}], "task": task}
    return pair, task, preferred(answer)


def write_split(out: Path, first_index: int, count: int, seed: int) -> dict:
    rng = random.Random(f"{seed}:{out.name}")

    def records() -> Iterator[tuple[dict, str, str]]:
        for index in range(first_index, first_index + count):
            pair, task, answer = make_pair(rng)
            yield {"__key__": f"pair_{index:07d}", "json": json.dumps(pair).encode()}, task, answer

    return write_answered_split(out, records(), CHAT_SFT.SYSTEM, SAMPLES_PER_SHARD,
                                {"format_version": FORMAT_VERSION, "seed": seed})


def build(train_out: Path, eval_out: Path, seed: int, train_samples: int, eval_samples: int) -> None:
    write_generated_splits(train_out, eval_out, train_samples, eval_samples,
                           lambda out, first, n: write_split(out, first, n, seed), unit="pairs")


def main(argv: list[str] | None = None) -> None:
    CHAT_SFT.chat_builder_main(__doc__, FORMAT_VERSION, build, (TRAIN_SAMPLES, EVAL_SAMPLES), argv)


if __name__ == "__main__":
    main()
