"""Chat samples with media as users have them: jsonl records that name image and video files.

A record is one conversation whose media live in files beside it, in either layout users bring
from LLaMA-Factory or Qwen-VL's own fine-tuning scripts:

- markers in the text and the files in lists named after the kind: ``{"messages": [{"role": "user",
  "content": "<image>What is it?"}, ...], "images": ["img/0.png"], "videos": ["clips/a.npz"]}``
  (``<kind>s``: ``images``, ``videos``, ``audios``); ShareGPT ``conversations`` (``from`` /
  ``value``) too;
- Qwen's content lists: ``{"role": "user", "content": [{"type": "image", "image": "img/0.png"},
  {"type": "text", "text": "What is it?"}]}``: each media part becomes its kind's marker where it
  stands, its file the next item of that kind.

A media part may also name no file (``{"type": "image"}``, TRL's vision format): its marker stands
there and its file is the next of the ``<kind>s`` list. Paths are relative to the jsonl file's
folder, or absolute (a ``file://`` prefix is dropped). A file must end with one of its kind's member
suffixes (an image ``png`` / ``jpg`` / ``jpeg`` / ``webp``, a Qwen-VL video ``npz`` as ``video.npz``
members hold). ``jsonl_record`` turns a record into the webdataset record the shards hold (the chat
``json`` member, one member per file numbered in marker order, and ``__sources__``: member -> the
file it was read from, for messages), so ``SampleProcessor`` reads both alike: the same processing,
the same rows. A ``RecordLayout`` makes the chat member from the record's JSON: a conversation's
(``conversation_layout``), or a preference pair's (``veomni/data/chat/media_preference.py``).
``record_media`` is the part the launcher's pre-pass shares (``record_check.py``): the messages and
the files a record names, without reading them.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from veomni.data.chat.conversation import SHAREGPT_ROLES, conversation_messages
from veomni.data.sources import InvalidSampleError


class MediaKindLike(Protocol):
    """What a modality (``MediaKind``) and a form (``MediaForm``) both have."""

    placeholder: str
    fields: tuple[str, ...]


def record_key(obj: Any, fallback: str) -> str:
    return str(obj["id"]) if isinstance(obj, dict) and "id" in obj else fallback


def record_media(obj: Any, kinds: Mapping[str, MediaKindLike], key: str) -> tuple[list[dict], dict[str, list[str]]]:
    """``(messages with string contents, kind -> the files it names, in marker order)`` of one
    record; an ``InvalidSampleError`` saying what is wrong with its layout."""
    if not isinstance(obj, dict):
        raise InvalidSampleError(f"sample {key!r}: a record must be a JSON object, got {type(obj).__name__}")
    if isinstance(obj.get("messages"), list):
        turns = obj["messages"]
    elif isinstance(obj.get("conversations"), list):
        turns = [{"role": SHAREGPT_ROLES.get(t.get("from"), t.get("from")), "content": t.get("value")}
                 if isinstance(t, dict) and "from" in t else t for t in obj["conversations"]]
    else:
        raise InvalidSampleError(f"sample {key!r}: expected a 'messages' list (OpenAI / Qwen style) or a "
                                 "'conversations' list (ShareGPT)")
    listed = {name: obj.get(f"{name}s") for name in kinds}
    for name, files in listed.items():
        if files is not None and not (isinstance(files, list) and all(isinstance(f, str) for f in files)):
            raise InvalidSampleError(f"sample {key!r}: '{name}s' must be a list of file paths, got {files!r}")
    inline: dict[str, list[str]] = {name: [] for name in kinds}
    messages = [_flat_turn(turn, kinds, inline, key, index) for index, turn in enumerate(turns)]
    both = sorted(name for name in kinds if listed[name] and inline[name])
    if both:
        raise InvalidSampleError(f"sample {key!r}: {both[0]} files are named both in content parts and in "
                                 f"'{both[0]}s': use one of the two")
    conversation_messages({"messages": messages}, key)  # roles, string contents, an answer: as chat_text checks
    return messages, {name: listed[name] or inline[name] for name in kinds}


def _flat_turn(turn: Any, kinds: Mapping[str, MediaKindLike], inline: dict[str, list[str]], key: str,
               index: int) -> Any:
    """A turn with a Qwen-style content list written as one string (markers where media parts stand,
    their files appended to ``inline``); other turns as they are (the encoder checks them)."""
    if not isinstance(turn, dict) or not isinstance(turn.get("content"), list):
        return turn
    text = []
    for part in turn["content"]:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind in kinds and isinstance(part.get(kind), str):
            text.append(kinds[kind].placeholder)
            inline[kind].append(part[kind])
        elif kind in kinds and kind not in part:  # no file here: the next of the '<kind>s' list
            text.append(kinds[kind].placeholder)
        else:
            known = ", ".join(["text", *kinds])
            raise InvalidSampleError(f"sample {key!r}: turn {index}: a content part must be {{'type': T, T: ...}} "
                                     f"with T one of {known}, got {part!r}")
    return {**turn, "content": "".join(text)}


def media_path(folder: Path, name: str) -> Path:
    """Where a record's file is: absolute, or relative to the jsonl's folder."""
    path = Path(name.removeprefix("file://")).expanduser()
    return path if path.is_absolute() else folder / path


def member_field(kind: MediaKindLike, name: str) -> str | None:
    """The member suffix a file of ``kind`` is read as (by its extension), or None when it has none."""
    extension = name.rsplit(".", 1)[-1].lower()
    return next((field for field in kind.fields if field.rsplit(".", 1)[-1] == extension), None)


RecordLayout = Callable[[Any, Mapping[str, MediaKindLike], str], tuple[dict, dict[str, list[str]]]]
"""(a jsonl record's JSON object, the kinds, its key) -> (the chat member's object with string contents,
kind -> the files it names in marker order); an ``InvalidSampleError`` saying what is wrong."""


def conversation_layout(obj: Any, kinds: Mapping[str, MediaKindLike], key: str) -> tuple[dict, dict[str, list[str]]]:
    """A conversation record's chat member: its other fields and its ``messages`` (``record_media``)."""
    messages, files = record_media(obj, kinds, key)
    meta = {k: v for k, v in obj.items() if k not in ("conversations", *(f"{name}s" for name in kinds))}
    return {**meta, "messages": messages}, files


def jsonl_record(line: bytes, folder: Path, kinds: Mapping[str, MediaKindLike], json_key: str,
                 layout: RecordLayout = conversation_layout) -> dict:
    """The webdataset record of a jsonl line (see the module docstring): the files are read here, so a
    missing one raises ``FileNotFoundError`` (the loader skips and counts the sample)."""
    key = line[:60].decode("utf-8", "replace").strip()
    try:
        obj = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidSampleError(f"sample {key!r} is not a utf-8 JSON object ({error})") from None
    key = record_key(obj, key)
    member, files = layout(obj, kinds, key)
    record: dict[str, Any] = {"__key__": key, json_key: json.dumps(member).encode(), "__sources__": {}}
    for name, names in files.items():
        for index, file in enumerate(names):
            field = member_field(kinds[name], file)
            if field is None:
                raise InvalidSampleError(f"sample {key!r}: {name} file {file!r} has none of the extensions "
                                         f"{[f.rsplit('.', 1)[-1] for f in kinds[name].fields]}")
            path = media_path(folder, file)
            if not path.is_file():
                raise FileNotFoundError(errno.ENOENT, f"sample {key!r}: {name} file not found", str(path))
            record[f"{index:05d}.{field}"] = path.read_bytes()
            record["__sources__"][f"{index:05d}.{field}"] = str(path)
    return record
