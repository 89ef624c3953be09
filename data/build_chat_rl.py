"""Build the prompts of the GRPO recipe (``recipes/rl/tiny_chat_grpo.yaml``): the chat SFT tasks
(reverse or sort a list of digits, ``data/build_chat_sft.py``) on lists of 6 digits, the longest SFT saw.

Why this set: its answers are exact, so an exact-match reward checks them, and the recipe's start
(the chat SFT model at step 150 of 300) is clearly imperfect on it (held-out greedy exact match
84.5%: it reverses almost always but misorders sorted lists) while its sampled answers are right
often enough for a group of 8 to disagree, which is what GRPO learns from. Longer lists do not
work: on 7 digits the SFT model is never right, greedy or sampled (0 of 448 samples at
temperature 1.0), so every group's rewards are equal and nothing is learned
(docs/post_training.md, the recipe's section). Records are ``chat_text``
conversations (webdataset shards, ``json`` member) whose last assistant turn is the hidden answer,
the ``chat_prompts`` kind's format; the tokenizer is the SFT set's (``<train-out>/../tokenizer``).

    python data/build_chat_rl.py --train-out data/cache/chat_rl/train --eval-out data/cache/chat_rl/eval
"""

from __future__ import annotations

from pathlib import Path

from veomni.data.builders import sibling_builder, write_generated_splits

FORMAT_VERSION = 3
LENGTHS = (6, 6)
TRAIN_SAMPLES, EVAL_SAMPLES = 4_000, 200

CHAT_SFT = sibling_builder(__file__, "build_chat_sft")  # the builder whose generator these prompts share


def build(train_out: Path, eval_out: Path, seed: int, train_samples: int, eval_samples: int) -> None:
    write_generated_splits(train_out, eval_out, train_samples, eval_samples,
                           lambda out, first, count: CHAT_SFT.write_split(out, first, count, seed, LENGTHS),
                           unit="prompts")


def main(argv: list[str] | None = None) -> None:
    CHAT_SFT.chat_builder_main(__doc__, FORMAT_VERSION, build, (TRAIN_SAMPLES, EVAL_SAMPLES), argv)


if __name__ == "__main__":
    main()
