"""Preference pairs with images and videos in the prompt (the ``chat_media_preference`` kind), for the
preference objectives on the VLM families (Qwen2.5-VL, the Seed1.5-VL-style ``omni``).

A record is one pair in TRL's conversational preference format, its media read as the chat loaders
read them (``media_jsonl.py``, ``media_dataset.py``):

- a jsonl line naming files: ``{"id": "v3", "images": ["img/3.png"], "prompt": [{"role": "user",
  "content": "<image>What color?"}], "chosen": [{"role": "assistant", "content": "Red."}],
  "rejected": [...]}``; or Qwen's content lists in the prompt (``{"type": "image", "image":
  "img/3.png"}``), or TRL's (``{"type": "image"}`` with the ``images`` list);
- a webdataset sample: the ``json`` member holds the pair (markers in the prompt) and the media are
  its members (``png``, ``0.png``, ``video.npz``...), as in a ``chat_media`` shard.

Media belong to the prompt, which the two halves share: a marker in a reply is refused. Each item is
decoded and processed once; each half (prompt + chosen, prompt + rejected) is encoded by the chat
loader's ``ChatEncoder`` (``data.chat_markup``) with targets on its reply only (assistant turns in the
prompt are context), and carries the same items, so the encoder sees the image in both halves and
each half gets its own positions (Qwen-VL's M-RoPE). A pair packs as two adjacent samples, chosen
then rejected, and costs both halves' text tokens plus encoder work (an image: its patches, twice).

Nothing is cut: the launcher reads every pair of the train and eval data first, decoding each
image and video, and refuses the run naming file and record when a pair is malformed (the text
kind's cases, a missing or unreadable media file, markers and items that do not pair up), when a
half is longer than ``data.max_seq_len``, or when the pair does not fit
``data.tokens_per_micro_batch`` (its cost is stated). Worker-side, a pair that went bad since is
skipped and counted like a ``chat_media`` sample.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from veomni.config.schema import DataConfig
from veomni.data.chat.media_dataset import (
    ChatSample,
    MultimodalChatDataset,
    SampleProcessor,
    UnreadableMedia,
    jsonl_folder,
    media_token_problems,
)
from veomni.data.chat.media_jsonl import MediaKindLike, RecordLayout, jsonl_record, record_media
from veomni.data.chat.preference_dataset import HALVES, check_pair_lists, pair_messages, pair_problem, pair_problems
from veomni.data.kinds import DatasetKind, DatasetRequest, register_dataset
from veomni.data.sources import InvalidSampleError
from veomni.data.text.packed import check_sample_length

COST = "text tokens and encoder patches"


@dataclass(frozen=True)
class MediaPair:
    chosen: ChatSample
    rejected: ChatSample

    def problem(self, cfg: DataConfig) -> str:
        key = self.chosen.key.removesuffix(".chosen")
        lengths = (len(self.chosen.chat.ids), len(self.rejected.chat.ids))
        return pair_problem(key, cfg, lengths, (self.chosen.cost, self.rejected.cost), COST)


def pair_layout(obj: Any, kinds: Mapping[str, MediaKindLike], key: str) -> tuple[dict, dict[str, list[str]]]:
    """``(the pair with string contents: markers where media parts stood, kind -> the files its
    prompt names)``; an ``InvalidSampleError`` saying what is wrong (a ``RecordLayout``)."""
    check_pair_lists(obj, key)
    lists = {f"{name}s": obj[f"{name}s"] for name in kinds if f"{name}s" in obj}
    prompt_turns = len(obj["prompt"])
    flat: dict[str, list[dict[str, str]]] = {}
    for half in HALVES:
        messages, files = record_media({"messages": [*obj["prompt"], *obj[half]], **lists}, kinds, key)
        for turn in messages[prompt_turns:]:
            held = [kind.placeholder for kind in kinds.values() if kind.placeholder in turn["content"]]
            if held:
                raise InvalidSampleError(f"pair {key!r}: the {half} reply holds {held[0]}: media belong in the "
                                         "prompt, which both halves share")
        flat["prompt"], flat[half] = messages[:prompt_turns], messages[prompt_turns:]
    pair_messages(flat, key)  # the text kind's checks: replies start with the assistant's turn
    meta = {k: v for k, v in obj.items() if k not in lists}
    return {**meta, **flat}, files


class PairProcessor:
    """Record -> ``MediaPair``: the media processed once, each half encoded with them."""

    def __init__(self, process: SampleProcessor) -> None:
        self.process = process

    def __call__(self, record: dict) -> MediaPair:
        key = str(record.get("__key__", "?"))
        raw = record.get(self.process.json_key)
        if raw is None:
            raise InvalidSampleError(f"pair {key!r} has no {self.process.json_key!r} member (data.text_key)")
        try:
            obj = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise InvalidSampleError(f"pair {key!r}: {self.process.json_key} is not JSON ({error})") from None
        pair, files = pair_layout(obj, self.process.kinds, key)
        if any(files.values()):
            raise InvalidSampleError(f"pair {key!r}: a webdataset sample's media are its members (png, video.npz, "
                                     "...); file paths belong in a jsonl record")
        media = self.process.media(record)
        counts = {name: [item.num_tokens for item in items] for name, items in media.items()}
        prompt = self.process.chat.encode(pair["prompt"], counts, key)
        encoder_cost = sum(item.cost for items in media.values() for item in items)
        halves = []
        for half in HALVES:
            chat = self.process.chat.encode([*pair["prompt"], *pair[half]], counts, key)
            if chat.ids[:len(prompt.ids)] != prompt.ids:
                raise InvalidSampleError(f"pair {key!r}: the {half} half does not start with the prompt's tokens")
            targets = [target and i >= len(prompt.ids) for i, target in enumerate(chat.targets)]
            chat = replace(chat, targets=targets)
            halves.append(ChatSample(f"{key}.{half}", chat, media, len(chat.ids) + encoder_cost))
        return MediaPair(*halves)


class MediaPreferenceDataset(MultimodalChatDataset):
    """``MultimodalChatDataset`` whose item is a pair (see the module docstring)."""

    record_layout = staticmethod(pair_layout)

    def _make(self, process: SampleProcessor, record: dict) -> MediaPair:
        return PairProcessor(process)(record)

    def _problem(self, item: MediaPair) -> str:
        return item.problem(self.cfg)

    def _cost(self, item: MediaPair) -> int:
        return item.chosen.cost + item.rejected.cost

    def _pack(self, items: list[MediaPair]) -> dict:
        return next(iter(self.process.values())).pack([half for pair in items for half in (pair.chosen, pair.rejected)])


MediaCheck = Callable[[SampleProcessor, dict], str]
"""(the sample processor, a webdataset record) -> why the record's item cannot train ('' when it can);
raises what reading it raises (``InvalidSampleError``, ``UnreadableMedia``, ``FileNotFoundError``)."""


def media_record_problems(cfg: DataConfig, model_config: Any, tokenizer: Any, kind: str, layout: RecordLayout,
                          check_item: MediaCheck) -> list[str]:
    """``check_item`` on every record of the train and eval data (``pair_problems``), a jsonl line read
    with its files as ``layout`` says: each problem names file and record."""
    processors: dict[str, SampleProcessor] = {}

    def check(path: str, where: str, fmt: str, record: Any, text_key: str) -> str:
        if text_key not in processors:
            processors[text_key] = SampleProcessor(tokenizer, model_config, text_key, cfg.chat_markup)
        process = processors[text_key]
        try:
            if fmt == "jsonl":
                record = jsonl_record(record, jsonl_folder(path), process.kinds, text_key, layout)
            return check_item(process, record)
        except (InvalidSampleError, UnreadableMedia, FileNotFoundError) as error:
            return str(error)

    return pair_problems(cfg, kind, check)


def check_media_records(cfg: DataConfig, model_config: Any, kind: str, layout: RecordLayout,
                        check_item: MediaCheck) -> list[str]:
    """The chat media kind's checks of the tokenizer and the vocabulary, then every record, its media
    decoded (``media_record_problems``), before any worker starts."""
    problems = media_token_problems(cfg, model_config)
    if problems:
        return problems
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer, local_files_only=True)
    return media_record_problems(cfg, model_config, tokenizer, kind, layout, check_item)


def check_media_preference_data(cfg: DataConfig, model_config: Any) -> list[str]:
    """Every pair read, its media decoded, rendered and sized (``check_media_records``)."""
    return check_media_records(cfg, model_config, "chat_media_preference", pair_layout,
                               lambda process, record: PairProcessor(process)(record).problem(cfg))


def _build(request: DatasetRequest) -> MediaPreferenceDataset:
    r = request
    return MediaPreferenceDataset(r.cfg, r.split, r.tokenizer, r.dp_rank, r.dp_size, r.seed, r.model_config)


register_dataset(DatasetKind("chat_media_preference", _build, needs_tokenizer=True, check=check_media_preference_data,
                             check_plan=check_sample_length, balances=True))
