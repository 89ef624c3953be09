"""Hang detection: a rank that makes no progress reports where it is stuck and exits fast.

A stuck collective otherwise hangs every rank until the process-group timeout, with no word on
which collective or which rank. Here each rank runs a daemon thread that the trainer feeds a
heartbeat at phase boundaries (``beat("step 15")``, ``beat("eval at step 20")``, checkpoint
save and load). With no beat for ``train.collective_timeout_s`` the thread writes a report
(``hang_report.py``: the phase, the collective the main thread waits in and who called it, or
"not in a collective", and the full main-thread stack) to stderr and to
``<output_dir>/hang_reports/rank_XXXXX.txt`` (``rank_XXXXX.restart_N.txt`` after the Nth
restart), then ends the process with ``os._exit(124)`` so torchrun restarts the group
(``train.max_restarts``) instead of waiting.

- Warm-up: the first phase of each kind after a (re)start (start-up, the first step, the first
  eval, the first checkpoint save) may compile, fill caches or create folders: it gets
  ``WARMUP_FACTOR`` x the timeout.
- A rank outside any collective (the one the others wait for) waits ``culprit_grace_s`` before
  exiting, so the ranks waiting for it write their reports before its exit breaks their links.
- The process-group timeout is set above the longest watchdog limit (``process_group_timeout_s``)
  so the report comes first; NCCL's own watchdog stays as the backstop.
- On NCCL the flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``, set by ``init_distributed``) is
  dumped beside the report (``rank_XXXXX.flight_recorder.pkl``, read with torch's
  ``torchfrtrace``): it names the collectives in flight, which the stack cannot show because
  NCCL collectives run asynchronously.
- A main thread that never releases the GIL would starve this thread; ``faulthandler`` (a C
  thread) then dumps every thread's stack and exits, ``FALLBACK_MARGIN_S`` later.

The thread also samples, every ``SAMPLE_S``, whether the main thread is inside a
``torch.distributed`` call: ``waited_s`` gives the time spent there since the last beat, which
the straggler check (``stragglers.py``) subtracts from the step time. Only armed with more than
one rank: a single process has no peer to wait for.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from veomni.train.fault.hang_report import collective_frame, format_report, locate

WARMUP_FACTOR = 3
PG_TIMEOUT_MARGIN_S = 60.0
FALLBACK_MARGIN_S = 60.0
SAMPLE_S = 0.02
HANG_EXIT_CODE = 124


def process_group_timeout_s(collective_timeout_s: float) -> float:
    """Longer than any watchdog limit, so the watchdog's report comes before torch's timeout."""
    return collective_timeout_s * WARMUP_FACTOR + PG_TIMEOUT_MARGIN_S


def culprit_grace_s(collective_timeout_s: float) -> float:
    return min(10.0, max(2.0, 0.1 * collective_timeout_s))


class Watchdog:
    def __init__(self, timeout_s: float, report_dir: Path, rank: int, backend: str, armed: bool) -> None:
        """Watches the calling thread; ``armed`` False: beats are recorded, nothing is watched."""
        self.timeout_s = timeout_s
        self.report_dir = report_dir
        self.rank = rank
        self.backend = backend
        self.armed = armed
        self._watched = threading.get_ident()
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # a restart keeps earlier reports
        self._name = f"rank_{rank:05d}" + (f".restart_{restart}" if restart else "")
        self._lock = threading.Lock()
        self._kinds_seen: set[str] = set()
        self._phase, self._since, self._limit = "start-up", time.monotonic(), 0.0
        self._waited_s = 0.0
        self._stop = threading.Event()
        self.beat("start-up")
        if armed:
            threading.Thread(target=self._watch, name="veomni-watchdog", daemon=True).start()

    @classmethod
    def for_run(cls, collective_timeout_s: float, output_dir: Path, rank: int, world_size: int,
                backend: str) -> Watchdog:
        return cls(collective_timeout_s, output_dir / "hang_reports", rank, backend, armed=world_size > 1)

    def beat(self, phase: str) -> None:
        """Progress: ``phase`` (its first word is its kind: ``step``, ``eval``, ...) starts now."""
        kind = phase.split()[0]
        limit = self.timeout_s * (1 if kind in self._kinds_seen else WARMUP_FACTOR)
        self._kinds_seen.add(kind)
        with self._lock:
            self._phase, self._since, self._limit = phase, time.monotonic(), limit
            self._waited_s = 0.0
        if self.armed:
            faulthandler.dump_traceback_later(limit + FALLBACK_MARGIN_S, exit=True, file=sys.__stderr__)

    def waited_s(self) -> float:
        """Seconds the watched thread has spent in ``torch.distributed`` calls since the last beat."""
        with self._lock:
            return self._waited_s

    def stop(self) -> None:
        if self.armed:
            self._stop.set()
            faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(SAMPLE_S):
            now = time.monotonic()
            frame = sys._current_frames().get(self._watched)
            with self._lock:
                if collective_frame(frame) is not None:
                    self._waited_s += now - max(last, self._since)  # none of it before the last beat
                phase, idle, limit = self._phase, now - self._since, self._limit
            last = now
            if idle > limit:
                self._expire(phase, idle, limit, frame)

    def _expire(self, phase: str, idle: float, limit: float, frame) -> None:
        where = locate(frame)
        allowed = f"{limit:g} s (train.collective_timeout_s" + (
            f" x {WARMUP_FACTOR}, the first phase of its kind)" if limit > self.timeout_s else ")")
        report = format_report(self.rank, phase, idle, allowed, where, self.backend)
        print(report, file=sys.stderr, flush=True)
        self._save(f"{self._name}.txt", report.encode())
        if self.backend == "nccl":
            self._save(f"{self._name}.flight_recorder.pkl", torch._C._distributed_c10d._dump_fr_trace)
        if where.collective is None:
            time.sleep(culprit_grace_s(self.timeout_s))
        sys.stderr.flush()
        os._exit(HANG_EXIT_CODE)

    def _save(self, name: str, content: bytes | Callable[[], bytes]) -> None:
        """Write one file of the report; a failure is said, never raised: the exit matters more."""
        try:
            data = content() if callable(content) else content
            self.report_dir.mkdir(parents=True, exist_ok=True)
            (self.report_dir / name).write_bytes(data)
        except Exception as exc:  # noqa: BLE001
            print(f"[watchdog] rank {self.rank}: could not write {self.report_dir / name}: {exc}",
                  file=sys.stderr, flush=True)
