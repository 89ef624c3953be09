"""Build the bundled chat fine-tuning set and its chat tokenizer: list tasks whose answers are
exact, so held-out accuracy shows what supervised fine-tuning on assistant turns taught.

Why this set: it is generated offline (no download), small enough for a tiny decoder to learn on
a CPU in minutes, and every answer is a deterministic function of the conversation, split
between the turns the loss never sees: the system prompt says what to do (reverse or sort), the
user turn gives the digits. A model answers right only by reading both, and its exact-match
accuracy is measured against baselines that read one of them or none (the echo of the user's
digits, the most common training answer).

Each conversation (``json`` member of a webdataset sample, OpenAI style, docs/data.md "Chat SFT")::

    system     "Reverse the list of digits." | "Sort the digits in ascending order."
    user       "7 2 9 4"            (3 to 6 digits)
    assistant  "4 9 2 7"            (or "2 4 7 9")
    [user, assistant: a second list, in 30% of the conversations]

Output: ``--train-out`` and ``--eval-out`` splits (shards + ``manifest.json``, written last, with
``FORMAT_VERSION``, the tasks' counts and, for eval, the baselines' held-out accuracy), and a
tokenizer folder beside them (``<train-out>/../tokenizer``): the bundled byte-level BPE
(``data/tokenizers/stdlib-bpe-8k``) plus the special tokens ``<|im_start|>`` (8192) and
``<|im_end|>`` (8193, also its eos) and a ChatML chat template (as Qwen's instruct models use)
with ``{% generation %}`` markers around what an assistant turn trains on. Everything is built
once and rebuilt when its version changes, atomically, under a file lock.

    python data/build_chat_sft.py --train-out data/cache/chat_sft/train --eval-out data/cache/chat_sft/eval
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from veomni.data.builders import (
    add_to_manifest,
    builder_main,
    is_complete,
    majority_baseline,
    publish_split,
    record_baseline,
    staging_folder,
    write_generated_splits,
)

FORMAT_VERSION = 1
TOKENIZER_VERSION = 1
TRAIN_SAMPLES = 40_000
EVAL_SAMPLES = 500
SAMPLES_PER_SHARD = 10_000
BASE_TOKENIZER = Path(__file__).resolve().parents[1] / "data" / "tokenizers" / "stdlib-bpe-8k"
SYSTEM = {"reverse": "Reverse the list of digits.", "sort": "Sort the digits in ascending order."}
TWO_EXCHANGES = 0.3
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{{- message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per turn; an assistant turn trains on its
content and its ``<|im_end|>\\n``."""


def write_chat_tokenizer(out: Path, base: Path = BASE_TOKENIZER) -> Path:
    """The base tokenizer with the ChatML special tokens and template, written to ``out`` (kept when
    current: its ``manifest.json`` has ``TOKENIZER_VERSION``)."""
    if is_complete(out, TOKENIZER_VERSION):
        return out
    from transformers import AutoTokenizer  # here: a cached build needs no transformers (1 s)

    tokenizer = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = CHATML_TEMPLATE
    tmp = staging_folder(out)
    tokenizer.save_pretrained(str(tmp))
    (tmp / "manifest.json").write_text(json.dumps({"format_version": TOKENIZER_VERSION, "base": base.name}) + "\n")
    if out.exists():
        if not (out / "manifest.json").is_file():  # not written here: never delete someone's folder
            sys.exit(f"{out} exists but was not written by this script; remove it or build the data elsewhere")
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"{out}: {base.name} + <|im_start|>, <|im_end|> and a ChatML chat template ({len(tokenizer)} tokens)")
    return out


def make_conversation(rng: random.Random, lengths: tuple[int, int] = (3, 6)) -> tuple[dict, str, str, str]:
    """``(conversation, task, the last user list, the last answer)``; lists of ``lengths`` digits (inclusive)."""
    task = rng.choice(tuple(SYSTEM))
    messages = [{"role": "system", "content": SYSTEM[task]}]
    for _ in range(2 if rng.random() < TWO_EXCHANGES else 1):
        digits = [str(rng.randrange(10)) for _ in range(rng.randint(*lengths))]
        answer = digits[::-1] if task == "reverse" else sorted(digits)
        messages += [{"role": "user", "content": " ".join(digits)}, {"role": "assistant", "content": " ".join(answer)}]
    return {"messages": messages, "task": task}, task, messages[-2]["content"], messages[-1]["content"]


def write_split(out: Path, first_index: int, count: int, seed: int,
                lengths: tuple[int, int] = (3, 6)) -> dict[str, Counter]:
    """``count`` conversations into ``out`` (staged, then renamed); the last answers' counts per task,
    and the echo baseline's hits under ``"echo"``."""
    import webdataset  # here, not at the top: it imports torch, and a cached run needs neither

    tmp = staging_folder(out)
    rng = random.Random(f"{seed}:{out.name}")
    answers: dict[str, Counter] = {task: Counter() for task in SYSTEM}
    echo: Counter = Counter()
    with webdataset.ShardWriter(str(tmp / "shard-%06d.tar"), maxcount=SAMPLES_PER_SHARD, verbose=0) as writer:
        for index in range(first_index, first_index + count):
            conversation, task, question, answer = make_conversation(rng, lengths)
            writer.write({"__key__": f"chat_{index:07d}", "json": json.dumps(conversation).encode()})
            answers[task][answer] += 1
            echo[task] += question == answer
    publish_split(tmp, out, {"samples": count, "format_version": FORMAT_VERSION, "seed": seed,
                             "tasks": {task: sum(c.values()) for task, c in answers.items()}})
    return {**answers, "echo": echo}


def build(train_out: Path, eval_out: Path, seed: int, train_samples: int, eval_samples: int) -> None:
    train, held_out = write_generated_splits(
        train_out, eval_out, train_samples, eval_samples,
        lambda out, first, count: write_split(out, first, count, seed), unit="conversations")
    echo = held_out.pop("echo")
    train.pop("echo")
    record_baseline(eval_out, majority_baseline(train, held_out), "answer",
                    "majority-answer baseline on the held-out split (the most common training answer per task):")
    echo_accuracy = {task: echo[task] / max(1, sum(held_out[task].values())) for task in SYSTEM}
    add_to_manifest(eval_out, echo_baseline=echo_accuracy)
    print("echo baseline (answer with the user's digits as given):",
          ", ".join(f"{task} {accuracy:.1%}" for task, accuracy in echo_accuracy.items()))


def chat_builder_main(doc: str, format_version: int, build: Callable[..., None], sample_counts: tuple[int, int],
                      argv: list[str] | None = None) -> None:
    """``builder_main`` for a set read with this set's tokenizer: it is written first, to
    ``<train-out>/../tokenizer`` (the chat SFT, preference and RL builders share it)."""
    argv = sys.argv[1:] if argv is None else argv
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--train-out", type=Path)
    train_out = where.parse_known_args(argv)[0].train_out
    if train_out is not None:  # the tokenizer is checked on every call: it is cheap, and a split may be cached
        write_chat_tokenizer(train_out.parent / "tokenizer")
    builder_main(doc, format_version, build, sample_counts=sample_counts, argv=argv)


def main(argv: list[str] | None = None) -> None:
    chat_builder_main(__doc__, FORMAT_VERSION, build, (TRAIN_SAMPLES, EVAL_SAMPLES), argv)


if __name__ == "__main__":
    main()
