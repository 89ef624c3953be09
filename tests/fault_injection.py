"""The fault-injection helpers the fault-tolerance tests are built on.

Process faults (a rank killed, stalled, or given a NaN loss at step k) are injected inside the
workers through ``VEOMNI_FAULTS`` (``veomni/train/fault/injection.py``), which ``faults_env`` spells for a
test's environment. File faults (a truncated or corrupted checkpoint file or data shard, a planted
pickle) are made here, on disk, between runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch


def kill(rank: int, step: int) -> str:
    return f"kill:rank={rank}:step={step}"


def stall(rank: int, step: int, seconds: float) -> str:
    return f"stall:rank={rank}:step={step}:seconds={seconds}"


def nan(step: int, times: int = 1) -> str:
    return f"nan:step={step}:times={times}"


def faults_env(*faults: str) -> dict[str, str]:
    """The environment that arms ``faults`` in every worker."""
    return {"VEOMNI_FAULTS": "; ".join(faults)}


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def flip_byte(path: Path) -> None:
    """Corrupt one byte in the middle: the size stays, the content does not."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


class _Payload:
    """Unpickling this runs ``touch marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant_pickle(checkpoint: Path, name: str, marker: Path) -> None:
    """Replace ``checkpoint/name`` by a state whose unpickling would create ``marker``, and rewrite
    ``complete.json``'s checksum of it, as an attacker who hands over the folder would."""
    path = checkpoint / name
    torch.save({"dp_rank": 0, "loader": _Payload(str(marker))}, path)
    meta = json.loads((checkpoint / "complete.json").read_text())
    data = path.read_bytes()
    meta["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "complete.json").write_text(json.dumps(meta))
