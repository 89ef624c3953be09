"""An agreed stop: every rank knows the run cannot go on, and restarting it would not help.

torchrun restarts the worker group after any non-zero exit, so a run stopped for a reason that a
restart would meet again (no checkpoint left to load, bad steps that recur, nodes that do not
share ``output_dir``) must not look like a crash. Every rank raises ``RunStopped`` at the same
point; the worker entry point then writes the message to ``VEOMNI_STOP_FILE`` (a file
``scripts/train.sh`` creates on each node and reads when torchrun returns) and exits 0, and
``train.sh`` prints the message and exits 1. Without ``VEOMNI_STOP_FILE`` (a worker started by
hand) the message goes to stderr and the exit status is 1.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

STOP_FILE_ENV = "VEOMNI_STOP_FILE"
STOPPED_EXIT = 1


class RunStopped(RuntimeError):
    """Raised on every rank at once with the same message; not a fault a restart can fix."""


def report_stop(exc: RunStopped) -> int:
    """Say why the run stopped; the worker's exit status (0 when ``train.sh`` will report it)."""
    stop_file = os.environ.get(STOP_FILE_ENV)
    if not stop_file:
        print(f"run stopped: {exc}", file=sys.stderr, flush=True)
        return STOPPED_EXIT
    if os.environ.get("LOCAL_RANK", "0") == "0":  # one writer per node; the file is node-local
        Path(stop_file).write_text(f"{exc}\n")
    return 0
