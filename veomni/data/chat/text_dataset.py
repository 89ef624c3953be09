"""Packed, resumable loader of text conversations for supervised fine-tuning (the ``chat_text`` kind).

A record is one conversation: a jsonl line that is the conversation object itself, or a
webdataset sample whose ``<key>.<text_key>`` member (``data.text_key: json``) holds it, OpenAI
style or ShareGPT (``veomni.data.chat.conversation``). It is rendered with the tokenizer's own
chat template, and only the assistant turns are loss targets (their ``{% generation %}`` spans, or
for a template without them their contents and what closes them; ``veomni.data.chat.conversation``):
labels are -100 on system and user turns and on the role headers.

One conversation is one packed sample (its own ``cu_seqlens`` span, positions from 0, its last
label -100), so attention and targets never cross conversations, and sequence or context
parallelism slices rows that already carry their labels. A conversation is kept through its last
assistant turn whose rendering ends within ``data.max_seq_len`` tokens (whole turns: no target
loses its context); one whose first answer does not fit is skipped and counted as bad, as is a record that
does not parse, has a turn with a missing or unknown role, has no assistant turn, or that the
template renders inconsistently (each logged with why).

Reading order, mixtures, consumer split, epochs, balancing and exact resume are the text loader's
(``PackedTextDataset``): this subclass only turns a record into its item and packs items.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from veomni.config.schema import DataConfig
from veomni.data.chat.conversation import ChatTokens, TemplateChat, conversation_messages
from veomni.data.chat.record_check import check_chat_jsonl
from veomni.data.chat.template_probe import chat_template_problems
from veomni.data.kinds import DatasetKind, DatasetRequest, register_dataset
from veomni.data.mixture import SourceSpec
from veomni.data.packing import pack_with_targets
from veomni.data.sources import InvalidSampleError, ReadStats, count_bad, iter_records, resolve_files, tar_samples
from veomni.data.text.packed import PackedTextDataset, check_sample_length, check_text_data

if TYPE_CHECKING:  # transformers loads in a second; only text datasets need it
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def record_conversation(record: Any, fmt: str, text_key: str) -> tuple[str, list[dict[str, str]]]:
    """``(a name for the record, its messages)``; an ``InvalidSampleError`` saying why it has none."""
    key, obj = record_object(record, fmt, text_key)
    return key, conversation_messages(obj, key)


def record_object(record: Any, fmt: str, text_key: str) -> tuple[str, Any]:
    """``(a name for the record, its JSON object)``: a jsonl line, or a webdataset sample's
    ``text_key`` member; an ``InvalidSampleError`` when it is not JSON."""
    if fmt == "webdataset":
        key = str(record.get("__key__", "?"))
        raw = record.get(text_key)
        if raw is None:
            raise InvalidSampleError(f"sample {key!r} has no {text_key!r} member (data.text_key)")
    else:
        raw = record
        key = raw[:60].decode("utf-8", "replace").strip()
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidSampleError(f"sample {key!r} is not a utf-8 JSON object ({error})") from None
    if fmt != "webdataset" and isinstance(obj, dict) and "id" in obj:
        key = str(obj["id"])
    return key, obj


def read_conversations(path: str, text_key: str = "json") -> Iterator[tuple[str, list[dict[str, str]]]]:
    """Every good conversation of a split (a folder of shards or jsonl files, or one file), in file
    order: ``(name, messages)``; bad records are skipped with a warning (the eval command reads
    held-out conversations with it)."""
    fmt, files = resolve_files(path)

    def read(file: Path) -> Iterator[Any]:
        if fmt == "webdataset":
            yield from tar_samples(file)
            return
        with open(file, "rb") as lines:
            yield from (line for line in lines if line.strip())

    for record in iter_records(files, read, max_bad_fraction=1.0, stats=ReadStats()):
        try:
            yield record_conversation(record, fmt, text_key)
        except InvalidSampleError as error:
            logger.warning("%s: skipped: %s", path, error)


class ChatTextDataset(PackedTextDataset):
    """``PackedTextDataset`` (sources, mixtures, consumer split, state) over conversations."""

    def __init__(self, cfg: DataConfig, split: str, tokenizer: PreTrainedTokenizerBase, dp_rank: int,
                 dp_size: int, seed: int) -> None:
        super().__init__(cfg, split, tokenizer, dp_rank, dp_size, seed)
        self.chat = TemplateChat(tokenizer)

    def _items(self, record: Any, spec: SourceSpec, first_offset: int,
               stats: ReadStats) -> Iterator[tuple[int, ChatTokens]]:
        """The record's one conversation (offset 0: never cut), or nothing when it is skipped and counted."""
        chat = self._encode(record, spec, stats)
        return iter(() if chat is None else ((0, chat),))

    def _cost(self, item: ChatTokens) -> int:
        return len(item.ids)

    def _pack(self, items: list[ChatTokens]) -> dict:
        return pack_with_targets([item.ids for item in items], [item.targets for item in items])

    def _encode(self, record: Any, spec: SourceSpec, stats: ReadStats) -> ChatTokens | None:
        origin = record.get("__url__", spec.path) if isinstance(record, dict) else spec.path
        try:
            key, messages = record_conversation(record, self.formats[spec.name], spec.text_key)
            return self.chat.fit(messages, key, self.cfg.max_seq_len)
        except InvalidSampleError as error:
            logger.warning("%s: skipped, counted as bad: %s", origin, error)
            count_bad(stats, origin, self.max_bad_fraction)
            return None


def check_chat_template(cfg: DataConfig, model_config: Any) -> list[str]:
    """The text kind's checks, then the tokenizer's chat template (``template_probe.py``)."""
    problems = check_text_data(cfg, model_config)
    if problems:
        return problems
    from transformers import AutoTokenizer

    return chat_template_problems(AutoTokenizer.from_pretrained(cfg.tokenizer, local_files_only=True))


def check_chat_text_data(cfg: DataConfig, model_config: Any) -> list[str]:
    """The template's checks, then every jsonl record (before any worker starts: ``record_check.py``)."""
    return check_chat_template(cfg, model_config) or check_chat_jsonl(cfg, None)


def _build_chat_text(request: DatasetRequest) -> ChatTextDataset:
    r = request
    return ChatTextDataset(r.cfg, r.split, r.tokenizer, r.dp_rank, r.dp_size, r.seed)


register_dataset(DatasetKind("chat_text", _build_chat_text, needs_tokenizer=True, check=check_chat_text_data,
                             check_plan=check_sample_length, balances=True))
