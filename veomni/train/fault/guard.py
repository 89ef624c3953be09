"""The bad-step guard: a step whose loss or gradient norm is not finite, or whose loss spikes, is
not applied.

One overflow poisons every weight it touches, and the optimizer's moments keep the poison long
after: the guard stops it before ``optimizer.step``. The loss and the gradient norm it looks at are
already global (reduced over the ranks), and the ranks still agree on the verdict through one
MAX all-reduce, so every rank skips or applies the same steps. A skipped step moves neither the
optimizer nor the LR schedule nor the step counter; its data is consumed, so the next try of the
same step number sees the next batch (exactly as if the bad batch had not been in the data).

After ``max_bad_steps`` skipped steps in a row the trainer acts (``train.on_bad_steps``): it rolls
back to the newest checkpoint and goes on with the data after the bad window, as large-scale
training reports do for loss spikes (PaLM restarted ~100 steps early and skipped 200-500
batches), or stops with a message.
"""

from __future__ import annotations

import math
from collections import deque

import torch.distributed as dist

from veomni.train.distributed import all_reduce_values

REASONS = ("", "non-finite loss", "non-finite gradient norm", "loss spike")


class StepGuard:
    def __init__(self, spike_factor: float = 0.0, window: int = 20) -> None:
        """``spike_factor``: a loss above this multiple of the mean of the last ``window`` good
        losses is a spike (0: only non-finite values are bad)."""
        self.spike_factor = spike_factor
        self.recent: deque[float] = deque(maxlen=window)
        self.skipped = 0
        """Steps skipped in this process."""
        self.consecutive = 0
        """Bad steps since the last good one."""

    def _reason(self, loss: float, grad_norm: float) -> int:
        if not math.isfinite(loss):
            return 1
        if not math.isfinite(grad_norm):
            return 2
        full = len(self.recent) == self.recent.maxlen
        if self.spike_factor and full and loss > self.spike_factor * sum(self.recent) / len(self.recent):
            return 3
        return 0

    def verdict(self, loss: float, grad_norm: float) -> str:
        """Why this step must be skipped ("" to apply it), agreed by every rank of the world."""
        code = int(all_reduce_values([self._reason(loss, grad_norm)], op=dist.ReduceOp.MAX)[0])
        if code:
            self.skipped += 1
            self.consecutive += 1
        else:
            self.consecutive = 0
            self.recent.append(loss)
        return REASONS[code]

    def spike_reference(self) -> float | None:
        """The mean loss a spike is measured against (None before the window is full)."""
        return sum(self.recent) / len(self.recent) if len(self.recent) == self.recent.maxlen else None

    def reset(self) -> None:
        """After a rollback: the bad run is over, and the losses before it belong to other weights."""
        self.consecutive = 0
        self.recent.clear()
