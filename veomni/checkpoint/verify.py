"""Checksums of a checkpoint's files, and which checkpoint a run may resume from.

A checkpoint is published only when every rank finished writing (``manager.py``), but a file can
still be damaged afterwards: a disk that filled up under a copy, a truncated sync between sites,
a bit flipped at rest. ``complete.json`` therefore records the size and SHA-256 of every file in
the folder, computed at publish time by all ranks together (each hashes its share), and a run
checks them before it loads anything:

- the launcher compares sizes only (a ``stat`` per file; catches truncated and missing files
  before any worker starts);
- the workers compare hashes too, each rank its share of the files, and agree on the result.

``choose_checkpoint`` walks the candidates newest first and takes the first that checks out,
saying which ones it passed over and why; with ``resume: <path>`` there is no fallback, and a
damaged folder stops the run with the file named. A checkpoint written before checksums existed
(no ``files`` entry) is accepted with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

from veomni.errors import BadCheckpoint

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "complete.json"
FILES_KEY = "files"


def checkpoint_files(folder: Path) -> list[str]:
    """Every file of a checkpoint folder but the marker, as sorted relative names."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != COMPLETE_MARKER)


def digest(path: Path) -> dict[str, int | str]:
    with path.open("rb") as f:
        return {"size": path.stat().st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def share(names: list[str], rank: int, world: int) -> list[str]:
    """The files one rank hashes: every ``world``-th, so large shards spread over the ranks."""
    return names[rank::world]


def recorded_files(folder: Path) -> dict[str, dict] | None:
    """The ``files`` entry of ``complete.json`` (None for a checkpoint saved before checksums)."""
    return json.loads((folder / COMPLETE_MARKER).read_text()).get(FILES_KEY)


def file_problems(folder: Path, recorded: dict[str, dict], names: list[str], hashes: bool) -> list[str]:
    """What is wrong with ``names`` of ``folder`` against their recorded size (and hash)."""
    problems = []
    for name in names:
        path, want = folder / name, recorded[name]
        if not path.is_file():
            problems.append(f"{path} is missing")
            continue
        size = path.stat().st_size
        if size != want["size"]:
            problems.append(f"{path} is {size} bytes, but {want['size']} were written (truncated or replaced)")
        elif hashes and digest(path)["sha256"] != want["sha256"]:
            problems.append(f"{path} does not match the SHA-256 recorded when it was written (corrupted)")
    return problems


def size_problems(folder: Path) -> list[str]:
    """The launcher's cheap check: every recorded file present with its recorded size."""
    recorded = recorded_files(folder)
    return [] if recorded is None else file_problems(folder, recorded, sorted(recorded), hashes=False)


def choose_checkpoint(candidates: list[Path], problems: Callable[[Path], list[str]], explicit: bool,
                      root: Path) -> Path | None:
    """The first of ``candidates`` (newest first) without ``problems``; None when there are none.
    A damaged checkpoint is reported and passed over; ValueError names the damaged files when every
    candidate is damaged, or at once when ``explicit`` (the recipe named that one folder)."""
    damaged: list[str] = []
    for path in candidates:
        found = problems(path)
        if not found:
            if damaged:
                logger.warning("resuming from the previous complete checkpoint %s instead", path)
            return path
        logger.warning("checkpoint %s is damaged: %s", path, "; ".join(found))
        damaged.append(f"{path.name}: {'; '.join(found)}")
        if explicit:
            raise BadCheckpoint(f"checkpoint.resume={path} is damaged: {'; '.join(found)}. Point checkpoint.resume "
                                "at another checkpoint, or set it to auto to take the newest intact one")
    if damaged:
        raise BadCheckpoint(f"no intact checkpoint to resume from under {root}: {' | '.join(damaged)}. Restore "
                            "the files, delete the damaged folders to start from an older one, or set "
                            "checkpoint.resume: none to start over")
    return None
