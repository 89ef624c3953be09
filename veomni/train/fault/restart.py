"""What a (re)started worker group needs to know: which attempt this is, which run it belongs to,
and how many steps a restart lost.

``scripts/train.sh`` runs the workers under torchrun with ``--max-restarts``: when a worker dies
the whole group is stopped and started again, with ``TORCHELASTIC_RESTART_COUNT`` counting the
attempts and ``TORCHELASTIC_RUN_ID`` naming the run. Every checkpoint records that run id, so a
restarted group resumes from the newest checkpoint of its own run whatever ``checkpoint.resume``
says (``none`` must not start a crashed run over), and otherwise from what the recipe asks for;
that choice is ``CheckpointManager.choose_resume`` (``veomni/checkpoint/manager.py``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def restart_attempt() -> int:
    """0 for the first start of the worker group, n after its n-th restart."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def run_id() -> str:
    """The run's id, the same across restarts ("" outside torchrun)."""
    return os.environ.get("TORCHELASTIC_RUN_ID", "")


def last_logged_step(metrics_file: Path, tail_bytes: int = 1 << 20) -> int:
    """The step of the last whole record in ``metrics.jsonl`` (0 when there is none): how far the
    attempt before a restart got. Only the file's tail is read (a long run's file is large)."""
    if not metrics_file.is_file():
        return 0
    with metrics_file.open("rb") as f:
        f.seek(max(0, f.seek(0, 2) - tail_bytes))
        lines = f.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):  # a line cut short by the crash, or the tail's first
            continue
    return 0


def restart_record(output_dir: Path, step: int, max_restarts: int) -> dict[str, int]:
    """After a restart: ``{"steps_lost": n}`` for the first step record (the steps the dead attempt
    logged beyond the checkpoint resumed at ``step``, which are run again), and a log line; {} at
    the first start."""
    attempt = restart_attempt()
    if not attempt:
        return {}
    lost = max(0, last_logged_step(output_dir / "metrics.jsonl") - step)
    logger.warning("restart %d (of at most %d): resumed at step %d; the %d step(s) run since that checkpoint "
                   "are run again", attempt, max_restarts, step, lost)
    return {"steps_lost": lost}
