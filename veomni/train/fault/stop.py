"""An agreed stop: every rank knows the run cannot go on, and restarting it would not help.

torchrun restarts the worker group after any non-zero exit, so a run stopped for a reason that a
restart would meet again (no checkpoint left to load, bad steps that recur, nodes that do not
share ``output_dir``) must not look like a crash. Every rank raises ``RunStopped`` at the same
point; the worker entry point then writes the message to ``VEOMNI_STOP_FILE`` (a file
``scripts/train.sh`` creates on each node and reads when torchrun returns) and exits 0, and
``train.sh`` prints the message and exits 1. Without ``VEOMNI_STOP_FILE`` (a worker started by
hand) the message goes to stderr and the exit status is 1.

An error that one rank meets alone (``veomni.errors.BadInput``: a corrupt shard, a vocabulary
without room for placeholders, a pretrained folder whose parameters do not match) cannot wait for
the others: that rank writes the message, exits 1 so that torchrun ends the group, and the group
torchrun restarts finds the message and exits 0 before it imports torch (``report_input_error``,
``earlier_stop``). Any other error keeps its traceback and restarts the group.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from veomni.errors import BadInput

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


def restart_cannot_fix(exc: BaseException) -> bool:
    """Whether ``exc`` says the input is wrong (``veomni.errors.BadInput``: a recipe value, data, a
    checkpoint or pretrained folder that does not fit), which a restart would read again. Any other
    error, a ``ValueError`` a bug raises included, keeps its traceback and restarts: a dead peer, a
    hang or a lost node shows as a collective's ``RuntimeError`` or a kill."""
    return isinstance(exc, BadInput)


def report_input_error(exc: BaseException) -> int:
    """Stop a run that one rank found unfixable: the message once, without a traceback, and an exit
    status that makes torchrun end the group (the other ranks would wait for this one). The group
    torchrun then restarts finds the message (``earlier_stop``) and leaves before it starts."""
    message = str(exc).rsplit(f"\n{type(exc).__name__}: ", 1)[-1].strip()  # a data worker's wraps a traceback
    stop_file = os.environ.get(STOP_FILE_ENV)
    if stop_file and not earlier_stop():
        Path(stop_file).write_text(f"{message}\n")
    else:
        print(f"run stopped: {message}", file=sys.stderr, flush=True)
    return STOPPED_EXIT


def earlier_stop() -> str:
    """The message of a stop an earlier worker of this run left in ``VEOMNI_STOP_FILE`` ('' if none)."""
    stop_file = os.environ.get(STOP_FILE_ENV)
    return Path(stop_file).read_text().strip() if stop_file and Path(stop_file).is_file() else ""
