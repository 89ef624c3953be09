"""Prompts with images and videos and their hidden answers (the ``chat_media_prompts`` kind), for
online RL on the VLM families (``train.objective: grpo`` on Qwen2.5-VL, the Seed1.5-VL-style
``omni``; docs/post_training.md).

A record is a ``chat_media`` sample (a webdataset sample with its media members, or a jsonl line
naming its files, ``media_jsonl.py``) whose last assistant turn is the hidden answer, as for the
text ``chat_prompts`` kind (``prompt_dataset.py``): so a visual SFT set is an RL prompt set, and
``scripts/eval_vqa.sh`` scores its held-out split. The prompt is every turn before that answer,
media included, encoded by the chat loader with the generation prompt (``SampleProcessor``: the
media processed, each marker expanded to its placeholder tokens) into a ``ChatSample``, which the
rollout generates from and packs into the update's rows with its media (``veomni.generation``);
the metadata the rewards see is the text kind's (``prompt_meta``). A micro-batch holds whole
prompts up to ``data.tokens_per_micro_batch`` of cost (text tokens plus encoder patches):
``{"prompts": [ChatSample], "metas": [dict]}``.

Nothing is cut: the launcher reads every record of the train and eval data first, decoding each
image and video, and refuses the run naming file and record when a record is malformed (no last
assistant turn after the prompt, a missing or unreadable media file, markers and items that do not
pair up) or its prompt does not fit ``data.max_seq_len`` / ``data.tokens_per_micro_batch``
(``check_media_records``). Worker-side, a record that went bad since is skipped and counted like a
``chat_media`` sample.
"""

from __future__ import annotations

import json
from typing import Any

from veomni.config.schema import DataConfig
from veomni.data.chat.media_dataset import MultimodalChatDataset, SampleProcessor, sample_problem
from veomni.data.chat.media_jsonl import conversation_layout
from veomni.data.chat.media_preference import check_media_records
from veomni.data.chat.prompt_dataset import PromptItem, pack_prompt_items, prompt_and_answer, prompt_meta
from veomni.data.kinds import DatasetKind, DatasetRequest, register_dataset


def media_prompt(process: SampleProcessor, record: dict) -> PromptItem:
    """A record's prompt (its chat before the hidden answer, with its media) and metadata."""
    key = str(record.get("__key__", "?"))
    obj = process.messages(record)
    prompt, answer = prompt_and_answer(obj, key)
    prompt_record = {**record, process.json_key: json.dumps({**obj, "messages": prompt}).encode()}
    return PromptItem(process(prompt_record, add_generation_prompt=True), prompt_meta(obj, key, answer))


class MediaPromptsDataset(MultimodalChatDataset):
    """``MultimodalChatDataset`` whose item is a prompt with its media (see the module docstring)."""

    def _make(self, process: SampleProcessor, record: dict) -> PromptItem:
        return media_prompt(process, record)

    def _problem(self, item: PromptItem) -> str:
        return sample_problem(item.prompt, self.cfg)

    def _cost(self, item: PromptItem) -> int:
        return item.prompt.cost

    def _pack(self, items: list[PromptItem]) -> dict:
        return pack_prompt_items(items)


def check_media_prompts_data(cfg: DataConfig, model_config: Any) -> list[str]:
    """Every record read, its media decoded, its prompt encoded and sized (``check_media_records``)."""
    return check_media_records(cfg, model_config, "chat_media_prompts", conversation_layout,
                               lambda process, record: sample_problem(media_prompt(process, record).prompt, cfg))


def _build(request: DatasetRequest) -> MediaPromptsDataset:
    r = request
    return MediaPromptsDataset(r.cfg, r.split, r.tokenizer, r.dp_rank, r.dp_size, r.seed, r.model_config)


register_dataset(DatasetKind("chat_media_prompts", _build, needs_tokenizer=True, check=check_media_prompts_data))
