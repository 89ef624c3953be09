"""Straggler detection: name a rank that is persistently slower than the others.

In synchronous training every rank's step takes the same wall time: the fast ranks wait for the
slow one inside collectives. So the time compared is each rank's own work, the step's wall time
minus the time its main thread spent inside ``torch.distributed`` calls (sampled by the
watchdog thread, ``Watchdog.waited_s``). The trainer gathers it with the step's other
per-rank values in the one all-gather it does anyway, so the check costs no collective.

Every ``window`` steps the ranks' mean own times are compared with the median rank's (the lower
median: with two ranks, the faster one). A rank above ``factor`` x that median, and slower by
more than ``MIN_GAP_S`` (sampling noise on very short steps), is a straggler: named once per
window in the log and in that step's metrics (``stragglers``, ``slowest_rank``,
``slowest_ratio``). One slow step inside a window moves the mean by 1/window only.

What it sees: host-side slowness (data loading, CPU contention, a stalled process) on every
backend, and slow compute on gloo, where collectives block the main thread. On NCCL the main
thread does not wait inside collectives (it waits at the next GPU sync), so a slow GPU is not
told apart from the ranks waiting for it.
"""

from __future__ import annotations

import logging
import socket
import statistics

import torch.distributed as dist

logger = logging.getLogger(__name__)

MIN_GAP_S = 0.05
_FLOOR_S = 1e-3  # a median rank with no own work at all: ratios against 1 ms, not a division by 0


class StragglerDetector:
    def __init__(self, factor: float, window: int, hosts: list[str], log: bool = True) -> None:
        """``factor`` 0: off. ``hosts``: each rank's host name, for the log; ``log``: this rank
        writes the warnings (every rank computes the same result from the same gathered times)."""
        self.factor = factor
        self.log = log
        self.window = window
        self.hosts = hosts
        self._sums = [0.0] * len(hosts)
        self._steps = 0

    @classmethod
    def for_run(cls, factor: float, window: int) -> StragglerDetector:
        """Learns every rank's host name (one all-gather at start-up, none when the check is off)."""
        hosts = [socket.gethostname()] * dist.get_world_size()
        if factor and len(hosts) > 1:
            dist.all_gather_object(hosts, socket.gethostname())
        return cls(factor, window, hosts, log=dist.get_rank() == 0)

    def observe(self, step: int, own_times: list[float]) -> dict[str, object]:
        """Add one step's per-rank own times; at the end of a window, the metrics (else {})."""
        if not self.factor or len(own_times) < 2:
            return {}
        self._sums = [total + t for total, t in zip(self._sums, own_times)]
        self._steps += 1
        if self._steps < self.window:
            return {}
        means = [total / self._steps for total in self._sums]
        self._sums, self._steps = [0.0] * len(means), 0
        median = max(statistics.median_low(means), _FLOOR_S)
        slowest = max(range(len(means)), key=means.__getitem__)
        stragglers = [rank for rank, mean in enumerate(means)
                      if mean > self.factor * median and mean - median > MIN_GAP_S]
        first = step - self.window + 1
        for rank in stragglers if self.log else []:
            logger.warning("straggler: rank %d (host %s) spent %.3f s per step on its own work over steps %d-%d, "
                           "%.1fx the median rank's %.3f s (train.straggler_factor=%g)",
                           rank, self.hosts[rank], means[rank], first, step, means[rank] / median, median,
                           self.factor)
        return {"stragglers": stragglers, "slowest_rank": slowest, "slowest_ratio": means[slowest] / median}
