"""Shared pieces of the chat SFT tests: the ChatML tokenizer ``data/build_chat_sft.py`` writes (the
bundled byte-level BPE plus a template with ``{% generation %}`` markers, so transformers' own
``return_assistant_tokens_mask`` gives an independent loss mask), a varied set of conversations, and
writers of them as OpenAI-style jsonl, ShareGPT jsonl and webdataset shards."""

from __future__ import annotations

import json
from pathlib import Path

from tests.omni_utils import write_shard
from veomni.config.schema import DataConfig
from veomni.data.build_loader import build_dataloader
from veomni.data.builders import load_script
from veomni.data.resume import ResumableLoader
from veomni.data.text.packed import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
VOCAB = 8256
"""A model vocabulary that holds the chat tokenizer's 8,194 tokens."""


def chat_builder():
    """``data/build_chat_sft.py`` as a module."""
    return load_script(REPO / "data" / "build_chat_sft.py")


def write_chat_tokenizer(folder: Path) -> Path:
    return chat_builder().write_chat_tokenizer(folder)


def _turn(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


CONVERSATIONS = [
    [_turn("system", "Reverse the list of digits."), _turn("user", "7 2 9"), _turn("assistant", "9 2 7")],
    [_turn("user", "Name a colour."), _turn("assistant", "Blue, like the sky."),
     _turn("user", "And the assistant's favourite?"), _turn("assistant", "Green.\nDefinitely green.")],
    [_turn("system", "Be terse."), _turn("user", "user: what is 2+2? (assistant, answer)"), _turn("assistant", "4")],
    [_turn("user", "Déjà vu? ünïcode ✓"), _turn("assistant", "Oui ✓")],
    [_turn("system", "Sort the digits in ascending order."), _turn("user", "5 1 4"), _turn("assistant", "1 4 5"),
     _turn("user", "3 3 0 8"), _turn("assistant", "0 3 3 8"), _turn("user", "9 6"), _turn("assistant", "6 9")],
]
"""Single and multi-turn, with and without a system prompt, with role names and newlines inside
contents (so a mask found by string search or by a wrong offset shows)."""

SHAREGPT_FROM = {"system": "system", "user": "human", "assistant": "gpt"}


def openai_line(messages: list[dict], **extra) -> str:
    return json.dumps({"messages": messages, **extra})


def sharegpt_line(messages: list[dict]) -> str:
    return json.dumps({"conversations": [{"from": SHAREGPT_FROM[m["role"]], "value": m["content"]}
                                         for m in messages]})


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def write_chat_shard(path: Path, lines: list[str]) -> Path:
    """Each JSON line as the ``json`` member of its own sample."""
    return write_shard(path, [{"__key__": f"c{i:04d}", "json": line.encode()} for i, line in enumerate(lines)])


def chat_loader(path: Path, tokenizer: Path, split: str = "eval", dp_rank: int = 0, dp_size: int = 1,
                **overrides) -> ResumableLoader:
    cfg = DataConfig(kind="chat_text", train_path=str(path), eval_path=str(path), tokenizer=str(tokenizer),
                     **{"text_key": "json", "max_seq_len": 256, "tokens_per_micro_batch": 1024, **overrides})
    return build_dataloader(cfg, split, load_tokenizer(str(tokenizer)), dp_rank, dp_size, 0, None, kind="chat_text")
