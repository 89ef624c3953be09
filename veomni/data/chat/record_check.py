"""The launcher's pass over chat jsonl sources, before any worker starts: every record is parsed and
checked as the workers will check it (a turn without ``role``, an unknown role, an empty or non-string
content, no answer, a record that is not an object), and every media file a record names is looked up
(one ``stat`` each, no read), naming the file, its line and the path.

What follows is what a worker would do with the same record, decided here first:

- a media record whose layout is wrong stops a ``chat_media`` run (``InvalidSampleError``: skipping
  it would hide a bug in the data's producer), so the launcher refuses it;
- a ``chat_text`` record that is wrong, and a media file that is missing, are skipped and counted by
  a worker; the launcher refuses the data when they are more than ``data.max_bad_fraction`` of a
  source's records, and otherwise names them as a warning.

The pass reads each jsonl once (webdataset shards are left to the workers: their checks need the
members' bytes); it prints its progress every ``PROGRESS_EVERY`` records, so a large set shows it moves.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from veomni.config.schema import DataConfig
from veomni.data.chat.conversation import conversation_messages
from veomni.data.chat.media_jsonl import MediaKindLike, media_path, member_field, record_key, record_media
from veomni.data.mixture import run_sources
from veomni.data.sources import InvalidSampleError, resolve_files

PROGRESS_EVERY = 200_000
LISTED = 10
"""Findings named in a message; the rest are counted."""


@dataclass
class SourceFindings:
    """One source's pass: its record count, and ``file:line: why`` of each bad record."""

    records: int = 0
    stops: list[str] = field(default_factory=list)
    """Records a worker would stop the run on."""
    skipped: list[str] = field(default_factory=list)
    """Records a worker would skip and count."""


def check_chat_jsonl(cfg: DataConfig, kinds: Mapping[str, MediaKindLike] | None) -> list[str]:
    """Problems of every jsonl source of ``cfg`` (train and eval) that refuse the run; warnings go
    to stderr. ``kinds``: the model's media kinds (``chat_media``), None for ``chat_text``."""
    problems = []
    for split in ("train", "eval"):
        if split == "eval" and not cfg.eval_path:
            continue
        for spec in run_sources(cfg, split):
            try:
                fmt, files = resolve_files(spec.path, spec.format)
            except (FileNotFoundError, ValueError):
                continue  # the text kind's own check names it
            if fmt != "jsonl":
                continue
            found = SourceFindings()
            for file in files:
                _scan(file, kinds, found)
            problems += _verdict(spec.path, found, cfg.max_bad_fraction)
    return problems


def _scan(file: Path, kinds: Mapping[str, MediaKindLike] | None, found: SourceFindings) -> None:
    with open(file, "rb") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            found.records += 1
            if found.records % PROGRESS_EVERY == 0:
                print(f"[launch] checked {found.records:,} chat records (now {file}:{number})", file=sys.stderr,
                      flush=True)
            where = f"{file}:{number}"
            try:
                obj = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                found.skipped.append(f"{where}: not a utf-8 JSON object ({error})")
                continue
            key = record_key(obj, where)
            try:
                if kinds is None:
                    conversation_messages(obj, key)
                    continue
                _, names = record_media(obj, kinds, key)
            except InvalidSampleError as error:
                (found.skipped if kinds is None else found.stops).append(f"{where}: {error}")
                continue
            for kind, paths in names.items():
                for name in paths:
                    if member_field(kinds[kind], name) is None:
                        found.stops.append(f"{where}: {kind} file {name!r} has none of the extensions "
                                           f"{[f.rsplit('.', 1)[-1] for f in kinds[kind].fields]}")
                    elif not media_path(file.parent, name).is_file():
                        found.skipped.append(f"{where}: {kind} file not found: {media_path(file.parent, name)}")


def _listed(findings: list[str]) -> str:
    more = f"\n  ... and {len(findings) - LISTED} more" if len(findings) > LISTED else ""
    return "".join(f"\n  {finding}" for finding in findings[:LISTED]) + more


def _verdict(path: str, found: SourceFindings, max_bad_fraction: float) -> list[str]:
    if found.stops:
        return [f"{path}: {len(found.stops)} chat record(s) a worker would stop the run on; fix or remove "
                f"them:{_listed(found.stops)}"]
    if not found.skipped:
        return []
    share = len(found.skipped) / found.records
    if share > max_bad_fraction:
        return [f"{path}: {len(found.skipped)} of {found.records} chat records are bad ({share:.1%} > "
                f"data.max_bad_fraction {max_bad_fraction:.1%}); fix or remove them, or raise "
                f"data.max_bad_fraction:{_listed(found.skipped)}"]
    print(f"[launch] warning: {path}: {len(found.skipped)} of {found.records} chat records are bad and will be "
          f"skipped and counted (within data.max_bad_fraction {max_bad_fraction:.1%}):{_listed(found.skipped)}",
          file=sys.stderr)
    return []
