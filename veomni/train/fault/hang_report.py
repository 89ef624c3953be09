"""Where a stuck rank's main thread is: the collective it waits in, who called it, its stack.

Read from another thread (the watchdog's) with ``sys._current_frames()``, so it works while the
main thread is blocked inside a collective: gloo and NCCL release the GIL while they wait. The
collective is the innermost frame in ``torch.distributed`` (``all_reduce``, ``barrier``, FSDP's
all-gather wait, ...); its caller is the first frame outside torch. A stack with no
``torch.distributed`` frame is "not in a collective": on gloo that rank is the one the others
wait for (stalled in data loading, compute, I/O); on NCCL collectives run asynchronously, so a
rank waiting on one blocks at its next GPU sync instead and the flight recorder (see
``watchdog.py``) names the pending collective.
"""

from __future__ import annotations

import linecache
import os
import socket
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch
import torch.distributed

_DISTRIBUTED_DIR = os.path.dirname(torch.distributed.__file__) + os.sep
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PROJECT_ROOT = str(Path(__file__).resolve().parents[3]) + os.sep


def _frames_outward(frame: FrameType | None) -> list[FrameType]:
    """Innermost first."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def short_path(path: str) -> str:
    """``veomni/train/step.py``, ``torch/distributed/distributed_c10d.py``: where to look, briefly."""
    # torch's own folder first: a virtual environment may live inside the project
    for root in (os.path.dirname(_TORCH_DIR.rstrip(os.sep)) + os.sep, _PROJECT_ROOT):
        if path.startswith(root):
            return path[len(root):]
    return path


def describe_frame(frame: FrameType) -> str:
    """``veomni/train/step.py:95 count_global_loss_units``."""
    return f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"


def collective_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost ``torch.distributed`` frame of a stack (innermost ``frame``), or None."""
    for candidate in _frames_outward(frame):
        if candidate.f_code.co_filename.startswith(_DISTRIBUTED_DIR):
            return candidate
    return None


@dataclass
class Whereabouts:
    collective: str | None
    """``all_reduce (torch/distributed/distributed_c10d.py:2890)``; None: not in a collective."""
    called_from: list[str]
    """The collective's callers outside torch, innermost first (at most three)."""
    innermost: str
    """The innermost frame and its source line: what a rank outside any collective is doing."""
    stack: str


def locate(frame: FrameType | None) -> Whereabouts:
    """What the thread whose innermost frame is ``frame`` is doing."""
    frames = _frames_outward(frame)
    if not frames:
        return Whereabouts(None, [], "no Python frame (thread gone)", "")
    stack = "".join(traceback.format_stack(frames[0]))
    inner = frames[0]
    line = linecache.getline(inner.f_code.co_filename, inner.f_lineno).strip()
    innermost = describe_frame(inner) + (f": {line}" if line else "")
    found = collective_frame(frames[0])
    if found is None:
        return Whereabouts(None, [], innermost, stack)
    outer = frames[frames.index(found) + 1:]
    callers = [describe_frame(f) for f in outer if not f.f_code.co_filename.startswith(_TORCH_DIR)][:3]
    collective = f"{found.f_code.co_name} ({short_path(found.f_code.co_filename)}:{found.f_lineno})"
    return Whereabouts(collective, callers, innermost, stack)


def format_report(rank: int, phase: str, idle_s: float, limit: str, where: Whereabouts, backend: str) -> str:
    """The text a stuck rank writes to stderr and to ``hang_reports/rank_XXXXX.txt``; ``limit``
    says what the rank was allowed (``5 s (train.collective_timeout_s)``)."""
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    head = (f"[watchdog] {when}: rank {rank} (host {socket.gethostname()}, pid {os.getpid()}) made no progress "
            f"for {idle_s:.1f} s in phase '{phase}', limit {limit}; if this phase is just slow, "
            "raise train.collective_timeout_s")
    if where.collective is not None:
        chain = " <- ".join(where.called_from) or "torch internals"
        what = f"waiting in collective {where.collective}, called from {chain}"
    else:
        what = ("not in a collective (no torch.distributed call on the main thread's stack): the other "
                f"ranks are likely waiting for this one; it is at {where.innermost}")
        if backend == "nccl":
            what += ("\n  NCCL runs collectives asynchronously: a rank waiting on one blocks at its next GPU "
                     "sync, so see the flight recorder dump beside this report")
    return f"{head}\n  {what}\nmain thread stack (most recent call last):\n{where.stack}"
