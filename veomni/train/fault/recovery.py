"""What the trainer does with a step the guard rejected (``guard.py``), and the counts of every
fault the run survived, for its metrics.

A skipped step is logged to metrics.jsonl under the step number it tried (the step counter does
not move). After ``train.max_bad_steps`` of them in a row, ``train.on_bad_steps`` decides:
``rollback`` reloads the newest intact checkpoint (weights, optimizer, schedule, counters) but
keeps the data position and RNG, so the window from that checkpoint to the bad steps is skipped;
``stop`` ends the run. A rollback with no checkpoint, or a second one to the same checkpoint
(the bad steps came back before a newer checkpoint was saved), stops the run instead: that is an
unstable run, not one bad batch. Stops are ``RunStopped``: every rank reaches them at the same
step, since the verdicts are agreed.

``BadStepRecovery`` takes everything it uses as arguments (it was a trainer mixin that worked only
through the trainer's attributes); what a rollback restores is ``veomni/train/restore.py``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from veomni.checkpoint.manager import CheckpointManager, resolve_resume
from veomni.train.fault.guard import StepGuard
from veomni.train.fault.stop import RunStopped

logger = logging.getLogger(__name__)


class BadStepRecovery:
    """The bad-step policy of one run. Its inputs are explicit: the ``guard``'s verdicts, the
    recipe's ``max_bad_steps`` and ``on_bad_steps``, the run's ``checkpoints``, ``log(step,
    record)`` for metrics.jsonl, ``reload(path) -> step`` that restores a checkpoint's training
    state but not its data position (``veomni/train/restore.py`` with ``data=False``), and
    the worker group's ``restarts`` so far."""

    def __init__(self, guard: StepGuard, max_bad_steps: int, on_bad_steps: str, checkpoints: CheckpointManager,
                 log: Callable[[int, dict[str, Any]], None], reload: Callable[[Path], int], restarts: int) -> None:
        self.guard, self.max_bad_steps, self.on_bad_steps = guard, max_bad_steps, on_bad_steps
        self.checkpoints, self.log, self.reload = checkpoints, log, reload
        self.restarts, self.rollbacks = restarts, 0
        self._rolled_back_to: Path | None = None

    def counts(self) -> dict[str, int]:
        """Restarts, rollbacks and skipped steps so far, once there was one."""
        counts = {"restarts": self.restarts, "rollbacks": self.rollbacks, "skipped_steps": self.guard.skipped}
        return {key: value for key, value in counts.items() if value}

    def skipped(self, step: int, metrics: dict[str, Any]) -> None:
        """A step after ``step`` the guard rejected (nothing was updated): log it, and after
        ``max_bad_steps`` in a row roll back or stop (``train.on_bad_steps``)."""
        guard, attempted = self.guard, step + 1
        logger.warning("step %d skipped (%s: loss %.4g, grad norm %.4g): no update; %d bad step(s) in a row",
                       attempted, metrics["skipped"], metrics["loss"], metrics["grad_norm"], guard.consecutive)
        self.log(attempted, {"skipped": metrics["skipped"], "skipped_loss": metrics["loss"],
                             "grad_norm": metrics["grad_norm"], **self.counts()})
        if guard.consecutive < self.max_bad_steps:
            return
        what = f"{guard.consecutive} bad steps in a row at step {attempted} (last: {metrics['skipped']})"
        if self.on_bad_steps == "stop":
            raise RunStopped(f"{what}; train.on_bad_steps=stop. Lower train.lr or raise train.warmup_steps, check "
                             "the data of these steps, or set train.on_bad_steps: rollback")
        self._rollback(what, attempted)

    def _rollback(self, what: str, skipped_from: int) -> None:
        """Back to the newest intact checkpoint, keeping the data position: the bad window is skipped."""
        root = self.checkpoints.root
        self.checkpoints.wait()
        try:
            path = resolve_resume("auto", root, problems=self.checkpoints.problems)
        except ValueError as exc:
            raise RunStopped(f"{what}; cannot roll back: {exc}") from None
        if path is None:
            raise RunStopped(f"{what}; there is no checkpoint under {root} to roll back to. Set "
                             "checkpoint.interval so one is saved, or lower train.lr")
        if path == self._rolled_back_to:
            raise RunStopped(f"{what}, again after rolling back to {path.name} before a newer checkpoint was saved: "
                             "the run is unstable, not one bad batch. Lower train.lr or check the data")
        step = self.reload(path)
        self.guard.reset()
        self._rolled_back_to, self.rollbacks = path, self.rollbacks + 1
        logger.warning("%s: rolled back to %s; training goes on from step %d with the data after the bad window "
                       "(the data of steps %d-%d is skipped)", what, path.name, step + 1, step + 1, skipped_from)
        self.log(step, {"rolled_back_to": step, **self.counts()})
