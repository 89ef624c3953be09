"""Fault injection: kill, stall or poison a rank at a chosen step of a real run.

The fault-tolerance tests (and anyone rehearsing a failure on a cluster) describe faults in the
``VEOMNI_FAULTS`` environment variable, which ``scripts/train.sh`` passes to every worker::

    VEOMNI_FAULTS="kill:rank=1:step=15"                 SIGKILL rank 1 as it starts step 15
    VEOMNI_FAULTS="stall:rank=0:step=3:seconds=120"     rank 0 sleeps before step 3
    VEOMNI_FAULTS="nan:step=5:times=3"                  step 5's loss is NaN on its first 3 tries
    VEOMNI_FAULTS="kill:rank=0:step=15; nan:step=20"    several faults, separated by ';'

``step`` is the optimizer step about to run (1-based: the first step is 1). ``rank`` is the global
rank; left out, every rank. ``times``: how often a fault fires in one process (a skipped step is
tried again at the same step number, so ``nan:step=5:times=3`` makes three consecutive bad
steps). ``attempt``: the restart attempt it fires in (torchrun's ``TORCHELASTIC_RESTART_COUNT``;
default 0, so a killed rank is not killed again after the restart).

A NaN is injected by a forward hook that multiplies the model's floating outputs by NaN: the loss
and every gradient become non-finite, exactly as after a real overflow. Nothing fires unless the
variable is set.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

ENV = "VEOMNI_FAULTS"
KINDS = ("kill", "stall", "nan")
_INT_FIELDS = ("rank", "step", "times", "attempt")


@dataclass
class Fault:
    kind: str
    step: int
    rank: int | None = None
    times: int = 1
    attempt: int = 0
    seconds: float = 3600.0
    fired: int = 0

    def due(self, rank: int, step: int, attempt: int) -> bool:
        return (self.step == step and self.rank in (None, rank) and self.attempt == attempt
                and self.fired < self.times)


def parse_faults(text: str) -> list[Fault]:
    """``"kill:rank=1:step=15; nan:step=5"`` -> faults; ValueError naming the part that is wrong."""
    faults = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kind, *fields = part.split(":")
        if kind not in KINDS:
            raise ValueError(f"{ENV}: {part!r}: unknown fault {kind!r}; one of {', '.join(KINDS)}")
        values: dict[str, Any] = {}
        for item in fields:
            key, sep, raw = item.partition("=")
            if not sep or key not in (*_INT_FIELDS, "seconds"):
                raise ValueError(f"{ENV}: {part!r}: {item!r} is not one of "
                                 f"{', '.join(k + '=N' for k in (*_INT_FIELDS, 'seconds'))}")
            values[key] = float(raw) if key == "seconds" else int(raw)
        if "step" not in values:
            raise ValueError(f"{ENV}: {part!r} needs step=N (the 1-based step it fires at)")
        faults.append(Fault(kind, **values))
    return faults


class FaultInjector:
    """This rank's faults from ``VEOMNI_FAULTS``; the trainer calls ``before_step`` before each step."""

    def __init__(self, rank: int, text: str | None = None) -> None:
        self.rank = rank
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.faults = parse_faults(os.environ.get(ENV, "") if text is None else text)
        self._poison = False
        if self.faults:
            logger.warning("fault injection armed on rank %d: %s", rank, os.environ.get(ENV, text))

    def attach(self, parts: list[nn.Module]) -> None:
        """Hook the modules whose outputs a ``nan`` fault poisons (no hook without such a fault)."""
        if any(f.kind == "nan" for f in self.faults):
            for part in parts:
                part.register_forward_hook(self._maybe_poison)

    def before_step(self, step: int) -> None:
        """Fire the faults due at ``step`` (the 1-based step about to run) on this rank."""
        self._poison = False
        for fault in self.faults:
            if not fault.due(self.rank, step, self.attempt):
                continue
            fault.fired += 1
            logger.warning("fault injection: %s on rank %d at step %d", fault.kind, self.rank, step)
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "stall":
                time.sleep(fault.seconds)
            else:
                self._poison = True

    def _maybe_poison(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not self._poison:
            return output
        if torch.is_tensor(output) and output.is_floating_point():
            return output * math.nan
        if isinstance(output, tuple):
            return tuple(self._maybe_poison(module, args, o) for o in output)
        return output
