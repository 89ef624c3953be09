"""How a run comes back from a checkpoint: the one place that decides which checkpoint, what is
restored from it, how, and in which order.

Why one module: a resume touches the weights, the optimizer, the LR schedule, the EMA, the data
position, a balancing window and the RNG, and whether each comes back as saved, merged across a
changed data-parallel layout or re-dealt to the new ranks is one decision. The trainer builds a
``RunState`` and calls ``restore`` once; a rollback (``veomni/train/fault/recovery.py``) calls it
with ``data=False``. The mechanics stay below: DCP loading and tied names (``manager.py``), a
dataset kind's merge of loader states (``veomni/data/resume.py``), the exact re-deal of text
readers (``veomni/data/relayout.py``).

Which checkpoint is the manager's ``choose_resume`` (``checkpoint.resume``; a restarted worker
group takes its own run's newest; every candidate verified by ``verify.py``), called by the trainer.

What, in this order (``restore``):

1. model and optimizer through DCP (any world size, FSDP or pipeline layout), then the LR
   schedule's position, the step counters and the EMA averages;
2. unless ``data=False``, the data:
   - at the same data-parallel layout (dp size and loader workers; the ranks of one pipeline read
     the same data, so a changed pp size keeps it) each rank loads its own loader state,
     balancing window and RNG states: the run goes on exactly;
   - at another layout the dataset kind merges every old rank's loader state (``merge_states``),
     the old balancing windows are dealt round-robin to the new ranks (``pending_share``), and
     the RNG states are not restored (they stay as seeded).

The checkpoint's content is defined here too: ``app_state`` (the same on every rank, saved by
DCP) and ``rank_state`` (``rank_*.pt``), written by the save and read back by ``restore``.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from veomni.checkpoint.manager import CheckpointManager
from veomni.data.resume import own_state, restore_position
from veomni.errors import BadInput
from veomni.train.fault.stop import RunStopped

if TYPE_CHECKING:
    from veomni.train.ema import WeightEMA

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunState:
    """The objects a checkpoint restores into, and this rank's place in the data-parallel layout."""

    parts: list[nn.Module]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    ema: WeightEMA | None
    tied: dict[str, list[str]] | None
    """A tied parameter's names (``pipeline_tied.aliases``), read through one another."""
    loader: Any
    """The train loader (``veomni.data.resume.ResumableLoader``)."""
    dp_rank: int
    dp_size: int
    num_workers: int


@dataclass(frozen=True)
class Restored:
    step: int
    units_seen: int
    pending: list[list[Any]] | None
    """This rank's balancing window (drawn, not trained yet); None when the data was not restored."""


def app_state(run: RunState, step: int, units_seen: int) -> dict[str, Any]:
    """What every rank saves alike: the schedule, the counters, the EMA averages."""
    state = {"scheduler": run.scheduler.state_dict(), "step": step, "units_seen": units_seen}
    if run.ema is not None:
        state["ema"] = run.ema.state_dict()
    return state


def rank_state(run: RunState, pending: list[list[Any]]) -> dict[str, Any]:
    """What each rank saves for itself: its data position, its balancing window, its RNG states."""
    return {
        "dp_rank": run.dp_rank,
        "loader": run.loader.state_dict(),
        "pending": pending,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
    }


def restore(path: Path, checkpoints: CheckpointManager, run: RunState, data: bool = True) -> Restored:
    """Checkpoint ``path`` into ``run`` (the module docstring says what and in which order)."""
    try:
        app = app_state(run, 0, 0)
        meta, rank_states = checkpoints.load(path, run.parts, run.optimizer, app, run.tied)
    except BadInput as exc:  # a checkpoint that does not fit this run, or a rank-state file that is not plain
        # data: the same on every rank
        raise RunStopped(str(exc)) from None
    saved_base, base = meta.get("frozen_base"), checkpoints.layout.get("frozen_base")
    if saved_base != base:
        raise RunStopped(f"{path} was saved by a run whose frozen base was {saved_base}, and this run's is {base}: "
                         "a checkpoint that holds only the adapters resumes only onto the same base. Resume "
                         "with the recipe that wrote it, or set checkpoint.resume: none to start over")
    # Only the schedule's position: its per-param-group lists (base_lrs, _last_lr) follow this
    # layout's groups (a V pipeline rank holds two stage optimizers' groups, one process one set).
    saved = app["scheduler"]
    run.scheduler.load_state_dict({**run.scheduler.state_dict(), "last_epoch": saved["last_epoch"],
                                   "_step_count": saved["_step_count"]})
    if run.ema is not None:
        run.ema.load_state_dict(app["ema"])
    if not data:
        return Restored(int(app["step"]), int(app["units_seen"]), None)
    same = (meta["dp_size"], meta["num_workers"]) == (run.dp_size, run.num_workers)
    if not same:
        logger.warning("data-parallel layout changed (dp %d -> %d): data loader positions merged",
                       meta["dp_size"], run.dp_size)
    pending = restore_position(run.loader, rank_states, same, run.dp_rank, run.dp_size)
    if same:  # the run goes on exactly: its RNG states too (at another layout they stay as seeded)
        rng = own_state(rank_states, run.dp_rank)["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return Restored(int(app["step"]), int(app["units_seen"]), pending)
