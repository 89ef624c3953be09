"""Sampling off the critical path: mini-batches made in a background thread, ahead of the step.

``Prefetcher(make, positions, depth)`` runs ``make(position)`` for each position in order on a
daemon thread and keeps up to ``depth`` finished mini-batches in a queue, so sampling and feature
gathering (torch ops, which release the GIL) overlap the training step. ``get()`` returns the
next one; the caller times how long it waited.

Exactness: a mini-batch is a function of its position alone, so making it early changes nothing;
the position a checkpoint records is the caller's (what it was given), and made-ahead mini-batches
are dropped and made again after a resume. An exception in ``make`` is raised by the next ``get()``.
``close()`` (also on garbage collection of the generator that owns it) stops the thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

_POLL_S = 0.1


class Prefetcher:
    def __init__(self, make: Callable[[Any], Any], positions: Iterator[Any], depth: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(make, positions), daemon=True,
                                        name="graph-sampler")
        self._thread.start()

    def _run(self, make: Callable[[Any], Any], positions: Iterator[Any]) -> None:
        for position in positions:
            try:
                item = (make(position), None)
            except Exception as exc:  # handed to the consumer, which raises it
                item = (None, exc)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or item[1] is not None:
                return

    def get(self) -> Any:
        """The next mini-batch, once made."""
        value, error = self._queue.get()
        if error is not None:
            raise error
        return value

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
