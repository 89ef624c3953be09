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
"""

from __future__ import annotations

import logging
from typing import Any

from veomni.checkpoint.manager import resolve_resume
from veomni.train.fault.stop import RunStopped

logger = logging.getLogger(__name__)


class BadStepHandling:
    """Mixed into the ``Trainer``: uses its ``cfg``, ``step``, ``runner.guard``, ``checkpoints``,
    ``reporter``, ``_load`` and the counters ``restarts``, ``rollbacks`` and ``_rolled_back_to``."""

    def _fault_counts(self) -> dict[str, int]:
        """Restarts, rollbacks and skipped steps so far, once there was one."""
        counts = {"restarts": self.restarts, "rollbacks": self.rollbacks, "skipped_steps": self.runner.guard.skipped}
        return {key: value for key, value in counts.items() if value}

    def _skipped(self, metrics: dict[str, Any]) -> None:
        """A step the guard rejected (nothing was updated): log it, and after ``max_bad_steps`` in a
        row roll back or stop (``train.on_bad_steps``)."""
        guard, cfg, attempted = self.runner.guard, self.cfg.train, self.step + 1
        logger.warning("step %d skipped (%s: loss %.4g, grad norm %.4g): no update; %d bad step(s) in a row",
                       attempted, metrics["skipped"], metrics["loss"], metrics["grad_norm"], guard.consecutive)
        self.reporter.log(attempted, {"skipped": metrics["skipped"], "skipped_loss": metrics["loss"],
                                      "grad_norm": metrics["grad_norm"], **self._fault_counts()})
        if guard.consecutive < cfg.max_bad_steps:
            return
        what = f"{guard.consecutive} bad steps in a row at step {attempted} (last: {metrics['skipped']})"
        if cfg.on_bad_steps == "stop":
            raise RunStopped(f"{what}; train.on_bad_steps=stop. Lower train.lr or raise train.warmup_steps, check "
                             "the data of these steps, or set train.on_bad_steps: rollback")
        self._rollback(what)

    def _rollback(self, what: str) -> None:
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
        skipped_from = self.step + 1
        self._load(path)
        self.runner.guard.reset()
        self._rolled_back_to, self.rollbacks = path, self.rollbacks + 1
        self._last_saved_step = self.step
        logger.warning("%s: rolled back to %s; training goes on from step %d with the data after the bad window "
                       "(the data of steps %d-%d is skipped)", what, path.name, self.step + 1, self.step + 1,
                       skipped_from)
        self.reporter.log(self.step, {"rolled_back_to": self.step, **self._fault_counts()})
