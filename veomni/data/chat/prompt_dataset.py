"""Resumable loader of prompts with hidden answers (the ``chat_prompts`` kind), for online RL
(``train.objective: grpo``, docs/post_training.md).

A record is a conversation in the ``chat_text`` format whose last assistant turn is the hidden
answer: ``{"messages": [..., {"role": "user", ...}, {"role": "assistant", "content": "42"}]}``
(an ``id`` names it). The prompt is every turn before that last assistant turn, rendered with the
tokenizer's chat template and its generation prompt (what the model answers from, as
``scripts/eval_chat.sh`` renders it); the metadata the rewards see is the record's other fields
plus ``answer`` (the last assistant turn's content). So an SFT data set is an RL prompt set, and
the held-out split is scored by ``scripts/eval_chat.sh`` as for SFT.

A micro-batch holds whole prompts up to ``data.tokens_per_micro_batch`` prompt tokens:
``{"prompts": [[int]], "metas": [dict]}`` (lists, not a packed row: the objective generates
from them; ``pack_prompt_items``). Position, epochs and resume are the text loader's
(``PackedTextDataset``). The ``chat_media_prompts`` kind (``media_prompts.py``) gives the same
items and micro-batches with each prompt a chat with its images and videos.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from veomni.data.chat.conversation import conversation_messages
from veomni.data.chat.media_dataset import ChatSample
from veomni.data.chat.text_dataset import ChatTextDataset, check_chat_template, record_object
from veomni.data.kinds import DatasetKind, DatasetRequest, register_dataset
from veomni.data.mixture import SourceSpec
from veomni.data.sources import InvalidSampleError, ReadStats, count_bad

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptItem:
    prompt: list[int] | ChatSample
    """The prompt's token ids, or (``chat_media_prompts``) its chat with its media."""
    meta: Mapping[str, Any]


def prompt_meta(obj: Any, key: str, answer: str) -> dict[str, Any]:
    """What the rewards see: the record's fields but its conversation, the hidden ``answer`` and ``id``."""
    extra = {k: v for k, v in obj.items() if k != "messages"} if isinstance(obj, dict) else {}
    return {**extra, "answer": answer, "id": key}


def pack_prompt_items(items: list[PromptItem]) -> dict:
    """A micro-batch of prompts: ``{"prompts": [...], "metas": [dict], "num_samples": n}``."""
    return {"prompts": [item.prompt for item in items], "metas": [dict(item.meta) for item in items],
            "num_samples": len(items)}


def prompt_and_answer(obj: Any, key: str) -> tuple[list[dict[str, str]], str]:
    """``(the turns before the last assistant turn, its content)``; an ``InvalidSampleError`` when
    there is no assistant turn after a user turn."""
    messages = conversation_messages(obj, key)
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    if last < 1:
        raise InvalidSampleError(f"prompt {key!r}: needs a last assistant turn (the hidden answer) after the prompt")
    return messages[:last], messages[last]["content"]


class ChatPromptsDataset(ChatTextDataset):
    """``ChatTextDataset`` whose item is a prompt and its metadata (see the module docstring)."""

    def _cost(self, item: PromptItem) -> int:
        return len(item.prompt)

    def _pack(self, items: list[PromptItem]) -> dict:
        return pack_prompt_items(items)

    def _encode(self, record: Any, spec: SourceSpec, stats: ReadStats) -> PromptItem | None:
        origin = record.get("__url__", spec.path) if isinstance(record, dict) else spec.path
        try:
            key, obj = record_object(record, self.formats[spec.name], spec.text_key)
            prompt, answer = prompt_and_answer(obj, key)
            ids = self.chat.prompt(prompt, key)
            if len(ids) > self.cfg.max_seq_len:
                raise InvalidSampleError(f"prompt {key!r} has {len(ids)} tokens, over data.max_seq_len")
        except InvalidSampleError as error:
            logger.warning("%s: skipped, counted as bad: %s", origin, error)
            count_bad(stats, origin, self.max_bad_fraction)
            return None
        return PromptItem(ids, prompt_meta(obj, key, answer))


def _build_chat_prompts(request: DatasetRequest) -> ChatPromptsDataset:
    r = request
    return ChatPromptsDataset(r.cfg, r.split, r.tokenizer, r.dp_rank, r.dp_size, r.seed)


register_dataset(DatasetKind("chat_prompts", _build_chat_prompts, needs_tokenizer=True, check=check_chat_template))
