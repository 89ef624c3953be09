"""Packed, resumable loader of chat samples with media, driven by the modality registry.

A sample is a webdataset record: a chat ``json`` member (``{"messages": [...], ...}``, see
docs/data.md) and one member per media item, whose suffix names the modality (``png`` -> image,
the model config's ``media_kinds()``, see ``veomni.contract.media``); or a jsonl line naming its
media files, read as the record it stands for (``media_jsonl.py``). Each item goes through its
modality's processor (patches for an
image), the text is tokenized with every marker expanded to one placeholder token per encoder
feature (``veomni.data.chat.template``), and samples are packed greedily under
``data.tokens_per_micro_batch``, where a sample costs its text tokens *plus* its encoder work
(an image: its patches), so rows with many images do not overload the encoders.

A batch is the text loader's dict (labels are -100 except on assistant tokens) plus
``media[name] = {"inputs": the encoder's collated inputs, "positions": placeholder positions}``
for each modality present in the row. The model config's ``media_layout()`` (``veomni.contract.media``)
says which tokens stand for an item and, for a family with its own positions (Qwen-VL's (t, h, w)),
how a sample's ``position_ids`` are computed; the processors are the family's (``media_kinds()``).
The layout's forms (``MediaForm``: Qwen-VL's videos) are read like modalities, each with its own
marker, members and processor, and packed into their encoder's media entry, items in row order.

Reading order, consumer split, epochs and exact resume are the text loader's
(``PackedTextDataset``). A media item that does not decode is skipped with its sample and
counted as a bad record; a sample whose placeholders and items do not pair up, or with a member
that reads but breaks its format (``BadMediaMember``), stops the run with its shard and key
(``InvalidSampleError``). Registered as the ``chat_media`` dataset kind.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from veomni.config.schema import DataConfig
from veomni.contract.media import BadMediaMember, MediaItem, MediaLayout, MediaModelConfig, collate_items
from veomni.data.chat.media_jsonl import RecordLayout, conversation_layout, jsonl_record
from veomni.data.chat.record_check import check_chat_jsonl
from veomni.data.chat.template import ChatEncoder, EncodedChat, chat_markup, layout_token_problems
from veomni.data.kinds import DatasetKind, DatasetRequest, register_dataset
from veomni.data.mixture import SourceSpec
from veomni.data.packing import pack_with_targets
from veomni.data.sources import InvalidSampleError, ReadStats, count_bad
from veomni.data.text.packed import PackedTextDataset, check_sample_length, check_text_data
from veomni.errors import BadConfig

if TYPE_CHECKING:  # transformers loads in a second; only text datasets need it
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class UnreadableMedia(Exception):
    """A media item whose bytes do not decode: a worker skips and counts its sample (a damaged
    file among many must not stop a run), the preference kinds' launcher check refuses it."""


@dataclass
class ChatSample:
    key: str
    chat: EncodedChat
    media: dict[str, list[MediaItem]]
    cost: int
    """Text tokens plus encoder work (see the module docstring)."""


class SampleProcessor:
    """Raw record -> ``ChatSample``: media through their processors, text through the chat encoder."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, model_config: MediaModelConfig,
                 json_key: str = "json", markup: str = "plain") -> None:
        """``markup``: ``data.chat_markup`` (``plain``, or ``model``: the family's ``ChatMarkup``)."""
        self.modalities = model_config.media_kinds()
        self.encoder_configs = model_config.encoder_configs
        self.json_key = json_key
        self.layout = model_config.media_layout()
        kinds = {**self.modalities, **self.layout.forms}  # every kind of item: the modalities and their forms
        self.kinds = kinds
        self.processors = {name: kind.processor for name, kind in kinds.items()}
        self.kind_of_field = {f: name for name, kind in kinds.items() for f in kind.fields}
        self.chat = ChatEncoder(tokenizer, {name: kind.placeholder for name, kind in kinds.items()}, self.layout,
                                chat_markup(model_config, markup))
        vocab = model_config.vocab_size
        if len(tokenizer) > vocab:
            raise BadConfig(
                f"the tokenizer has {len(tokenizer)} tokens with the placeholders "
                f"{sorted(self.chat.token_of)}, more than the LLM's vocab_size {vocab}; raise it"
            )

    def media_fields(self, record: dict) -> dict[str, list[str]]:
        """Kind of item -> the record's member suffixes holding its items, in sorted order (``png``,
        or ``0.png``, ``1.png``... for several; a field may have dots: ``video.npz``, ``0.video.npz``)."""
        found: dict[str, list[str]] = {name: [] for name in self.processors}
        for member in sorted(k for k in record if not k.startswith("__")):
            parts = member.split(".")
            names = (self.kind_of_field.get(".".join(parts[i:])) for i in range(len(parts)))
            name = next((n for n in names if n is not None), None)
            if name is not None:
                found[name].append(member)
        return found

    def messages(self, record: dict) -> dict:
        raw = record.get(self.json_key)
        if raw is None:
            raise InvalidSampleError(f"sample {record.get('__key__')!r} has no {self.json_key!r} member")
        meta = json.loads(raw)
        if not isinstance(meta, dict) or not isinstance(meta.get("messages"), list):
            raise InvalidSampleError(
                f"sample {record.get('__key__')!r}: {self.json_key} must be an object with a 'messages' list"
            )
        return meta

    def media(self, record: dict) -> dict[str, list[MediaItem]]:
        """Every media item processed (a form's by its encoder's config); an ``UnreadableMedia`` naming
        the sample and the member (or the file it was read from) on a damaged item, and an
        ``InvalidSampleError`` naming them on a ``BadMediaMember``."""
        out = {}
        for name, fields in self.media_fields(record).items():
            config, out[name] = self.encoder_configs[self.layout.encoder_of(name)], []
            for member in fields:
                try:
                    out[name].append(self.processors[name](record[member], config))
                except BadMediaMember as error:
                    raise InvalidSampleError(f"sample {record.get('__key__')!r}: member {member!r}: {error}") from None
                except Exception as error:  # noqa: BLE001 - a decoder raises what it likes on damaged bytes
                    source = record.get("__sources__", {}).get(member, f"member {member!r}")
                    raise UnreadableMedia(f"sample {record.get('__key__')!r}: {name} {source} does not decode "
                                          f"({type(error).__name__}: {error})") from error
        return out

    def __call__(self, record: dict, add_generation_prompt: bool = False) -> ChatSample:
        key = record.get("__key__", "?")
        meta = self.messages(record)
        media = self.media(record)
        chat = self.chat.encode(
            meta["messages"],
            {n: [i.num_tokens for i in items] for n, items in media.items()},
            key,
            add_generation_prompt,
        )
        cost = len(chat.ids) + sum(item.cost for items in media.values() for item in items)
        return ChatSample(key, chat, media, cost)

    def pack(self, samples: list[ChatSample]) -> dict:
        """``pack_chat_samples`` with the model's layout (its positions, its forms' encoders)."""
        return pack_chat_samples(samples, self.layout)


def pack_chat_samples(samples: list[ChatSample], layout: MediaLayout | None = None) -> dict:
    """One packed row: ``pack_with_targets`` of the ids (labels only where the next token is a
    target), and each modality's collated encoder inputs with its placeholder positions, items in
    row order. With a ``layout``: each sample's positions from its ``position_ids`` (in place of
    the 1-D ones), and the items of its forms in their encoder's entry."""
    batch = pack_with_targets([s.chat.ids for s in samples], [s.chat.targets for s in samples])
    if layout is not None and layout.position_ids is not None:
        batch["position_ids"] = torch.cat([layout.position_ids(torch.tensor(s.chat.ids, dtype=torch.long), s.media)
                                           for s in samples])
    entries: dict[str, list[tuple[list[int], MediaItem]]] = {}  # encoder -> (row positions, item) per item
    for sample, offset in zip(samples, batch["cu_seqlens"][:-1].tolist()):
        for name, items in sample.media.items():
            places = iter(sample.chat.placeholders[name])
            encoder = entries.setdefault(layout.encoder_of(name) if layout else name, [])
            encoder.extend(([offset + next(places) for _ in range(item.num_tokens)], item) for item in items)
    media: dict[str, dict] = {}
    for name, found in entries.items():
        if found:
            found.sort(key=lambda entry: entry[0][0])
            media[name] = {"inputs": collate_items([item for _, item in found]),
                           "positions": torch.tensor([p for places, _ in found for p in places], dtype=torch.long)}
    batch["media"] = media
    return batch


class MultimodalChatDataset(PackedTextDataset):
    """``PackedTextDataset`` (consumer split, epochs, state) over chat samples with media."""

    def __init__(
        self,
        cfg: DataConfig,
        split: str,
        tokenizer: PreTrainedTokenizerBase,
        dp_rank: int,
        dp_size: int,
        seed: int,
        model_config: Any,
    ) -> None:
        super().__init__(cfg, split, tokenizer, dp_rank, dp_size, seed)
        self.process = {spec.name: SampleProcessor(tokenizer, model_config, spec.text_key, cfg.chat_markup)
                        for spec in self.specs}
        self.jsonl_folder = {spec.name: jsonl_folder(spec.path) for spec in self.specs
                             if self.formats[spec.name] == "jsonl"}

    def _items(self, record: dict, spec: SourceSpec, first_offset: int,
               stats: ReadStats) -> Iterator[tuple[int, ChatSample]]:
        """The record's one sample (offset 0), or nothing when it is skipped and counted."""
        sample = self._process(record, spec, stats)
        return iter(() if sample is None else ((0, sample),))

    def _cost(self, item: ChatSample) -> int:
        return item.cost

    def _pack(self, items: list[ChatSample]) -> dict:
        return next(iter(self.process.values())).pack(items)

    record_layout: RecordLayout = staticmethod(conversation_layout)
    """How a jsonl record's JSON becomes the chat member of the record it stands for."""

    def _make(self, process: SampleProcessor, record: dict) -> Any:
        """The item of one record (a webdataset record, or what a jsonl line stands for)."""
        return process(record)

    def _problem(self, item: ChatSample) -> str:
        """Why ``item`` cannot train under the run's data config ('' when it can)."""
        return sample_problem(item, self.cfg)

    def _process(self, record: dict, spec: SourceSpec, stats: ReadStats) -> Any:
        """The processed item, or None (counted as bad) when a media item does not decode or is
        missing, or the item cannot fit a row."""
        process = self.process[spec.name]
        folder = self.jsonl_folder.get(spec.name)
        key, url = (None, spec.path) if folder is not None else (record.get("__key__"), record.get("__url__", "?"))
        try:
            if folder is not None:  # a jsonl line naming its files: read as the shard record it stands for
                record = jsonl_record(record, folder, process.kinds, process.json_key, self.record_layout)
                key = record["__key__"]
            item = self._make(process, record)
        except InvalidSampleError as error:
            raise InvalidSampleError(f"{url}: {error}") from error
        except Exception as error:  # noqa: BLE001 - a corrupt or missing media file must not stop the run
            logger.warning("%s: sample %s skipped: a media item does not decode or is missing (%s: %s)", url, key,
                           type(error).__name__, error)
            count_bad(stats, url, self.max_bad_fraction)
            return None
        problem = self._problem(item)
        if problem:
            logger.warning("%s: sample %s skipped: %s", url, key, problem)
            count_bad(stats, url, self.max_bad_fraction)
            return None
        return item


def sample_problem(sample: ChatSample, cfg: DataConfig) -> str:
    """Why ``sample`` cannot fit a row under ``cfg`` ('' when it can)."""
    if len(sample.chat.ids) > cfg.max_seq_len or sample.cost > cfg.tokens_per_micro_batch:
        return (f"{len(sample.chat.ids)} tokens / cost {sample.cost} exceed data.max_seq_len={cfg.max_seq_len} "
                f"or data.tokens_per_micro_batch={cfg.tokens_per_micro_batch}")
    return ""


def jsonl_folder(path: str) -> Path:
    """The folder a jsonl source's relative media paths start from: the jsonl file's own."""
    return Path(path) if Path(path).is_dir() else Path(path).parent


def _build_chat_media(request: DatasetRequest) -> MultimodalChatDataset:
    r = request
    return MultimodalChatDataset(r.cfg, r.split, r.tokenizer, r.dp_rank, r.dp_size, r.seed, r.model_config)


def check_chat_media_data(cfg: DataConfig, model_config: Any) -> list[str]:
    """``media_token_problems``, then every jsonl record and the media files it names (``record_check.py``)."""
    return media_token_problems(cfg, model_config) or check_chat_jsonl(cfg, {**model_config.media_kinds(),
                                                                             **model_config.media_layout().forms})


def media_token_problems(cfg: DataConfig, model_config: Any) -> list[str]:
    """The text kind's checks, then room in the LLM's vocabulary for the tokenizer with one placeholder
    token per modality added (the tokenizer and the model config suffice: a worker would meet it first)."""
    problems = check_text_data(cfg, model_config)
    if problems:
        return problems
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer, local_files_only=True)
    layout = model_config.media_layout()
    try:
        markup = chat_markup(model_config, cfg.chat_markup)
    except ValueError as error:
        return [str(error)]
    markers = [*layout.tokens(), *markup.tokens()]
    problems = layout_token_problems(tokenizer, layout, markup)
    if problems or len(tokenizer) <= model_config.vocab_size:
        return problems
    return [f"model.llm.vocab_size={model_config.vocab_size} has no room for the placeholder tokens {markers}: the "
            f"tokenizer ({cfg.tokenizer}) holds {len(tokenizer)} tokens with them; raise model.llm.vocab_size to at "
            f"least {len(tokenizer)}"]


register_dataset(DatasetKind("chat_media", _build_chat_media, needs_tokenizer=True, check=check_chat_media_data,
                             check_plan=check_sample_length,
                             balances=True))
