"""Straggler detection: name a rank that is persistently slower than the others.

In synchronous training every rank's step takes the same wall time: the fast ranks wait for the
slow one inside collectives. So the time compared is each rank's own work, the step's wall time
minus the time its main thread spent inside ``torch.distributed`` calls (sampled by the
watchdog thread, ``Watchdog.waited_s``). The trainer gathers it with the step's other
per-rank values in the one all-gather it does anyway, so the check costs no collective.

Every ``window`` steps each rank's mean own time is compared with the median rank's of its
pipeline stage (the ranks doing the same work; the lower median: with two ranks, the faster
one). A rank above ``factor`` x that median, and slower by more than ``MIN_GAP_S`` (sampling
noise on very short steps), is a straggler: named once per window in the log and in that step's
metrics (``stragglers``, ``slowest_rank``, ``slowest_ratio``: the largest ratio to its stage's
median). One slow step inside a window moves the mean by 1/window only.

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
    def __init__(self, factor: float, window: int, hosts: list[str], stages: list[int] | None = None,
                 log: bool = True) -> None:
        """``factor`` 0: off. ``hosts``: each rank's host name, for the log. ``stages``: each rank's
        pipeline stage; a rank is compared only with the ranks of its stage, which do the same work
        (None: one stage). ``log``: this rank writes the warnings (every rank computes the same
        result from the same gathered times)."""
        self.factor = factor
        self.window = window
        self.hosts = hosts
        self.stages = stages or [0] * len(hosts)
        self.log = log
        self._sums = [0.0] * len(hosts)
        self._steps = 0

    @classmethod
    def for_run(cls, factor: float, window: int, stage: int) -> StragglerDetector:
        """Learns every rank's host and pipeline stage (one all-gather at start-up, none when the
        check is off)."""
        peers = [(socket.gethostname(), stage)] * dist.get_world_size()
        if factor and len(peers) > 1:
            dist.all_gather_object(peers, (socket.gethostname(), stage))
        return cls(factor, window, [host for host, _ in peers], [s for _, s in peers], log=dist.get_rank() == 0)

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
        medians = [max(statistics.median_low(m for m, s in zip(means, self.stages) if s == stage), _FLOOR_S)
                   for stage in self.stages]
        ratios = [mean / median for mean, median in zip(means, medians)]
        slowest = max(range(len(means)), key=ratios.__getitem__)
        stragglers = [rank for rank, (mean, median) in enumerate(zip(means, medians))
                      if mean > self.factor * median and mean - median > MIN_GAP_S]
        for rank in stragglers if self.log else []:
            peers = f" of pipeline stage {self.stages[rank]}" if len(set(self.stages)) > 1 else ""
            logger.warning("straggler: rank %d (host %s) spent %.3f s per step on its own work over steps %d-%d, "
                           "%.1fx the median rank%s (%.3f s; train.straggler_factor=%g)",
                           rank, self.hosts[rank], means[rank], step - self.window + 1, step, ratios[rank], peers,
                           medians[rank], self.factor)
        return {"stragglers": stragglers, "slowest_rank": slowest, "slowest_ratio": ratios[slowest]}
