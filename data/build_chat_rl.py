"""Build the prompts of the GRPO recipe (``recipes/rl/tiny_chat_grpo.yaml``): the chat SFT tasks
(reverse or sort a list of digits, ``data/build_chat_sft.py``) on longer lists than SFT saw.

Why this set: its answers are exact, so an exact-match reward checks them, and the SFT model is
clearly imperfect on it: it learned lists of 3 to 6 digits and here gets 6 to 7, where it drops,
repeats or misorders digits often enough to be wrong on many prompts (held-out greedy exact match
47.0%) but right often enough in a group of sampled answers for GRPO to learn from the difference
(at 7 to 8 digits it is never right, so every group's rewards are equal and nothing is learned).
Records are ``chat_text``
conversations (webdataset shards, ``json`` member) whose last assistant turn is the hidden answer,
the ``chat_prompts`` kind's format; the tokenizer is the SFT set's (``<train-out>/../tokenizer``).

    python data/build_chat_rl.py --train-out data/cache/chat_rl/train --eval-out data/cache/chat_rl/eval
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_chat_sft import write_chat_tokenizer, write_split  # noqa: E402  (the SFT builder beside this one)

from veomni.data.builders import builder_main, write_generated_splits  # noqa: E402

FORMAT_VERSION = 2
LENGTHS = (6, 7)
TRAIN_SAMPLES, EVAL_SAMPLES = 4_000, 200


def build(train_out: Path, eval_out: Path, seed: int, train_samples: int, eval_samples: int) -> None:
    write_generated_splits(train_out, eval_out, train_samples, eval_samples,
                           lambda out, first, count: write_split(out, first, count, seed, LENGTHS), unit="prompts")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--train-out", type=Path)
    train_out = where.parse_known_args(argv)[0].train_out
    if train_out is not None:
        write_chat_tokenizer(train_out.parent / "tokenizer")
    builder_main(__doc__, FORMAT_VERSION, build, sample_counts=(TRAIN_SAMPLES, EVAL_SAMPLES), argv=argv)


if __name__ == "__main__":
    main()
