"""Bytes each rank sends, per kind of collective: for tests and benchmarks that check the
communication volume of a parallel recipe against its analytic formula, and for the trainer,
which reports each step's global bytes per kind (``comm_bytes_<kind>``).

Counted: the engine's own collectives (``KINDS``). Not counted: FSDP's parameter all-gathers and
gradient reduce-scatters (torch issues them) and the step's small metric all-reduces."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

KINDS = ("sp_all_to_all", "cp_kv", "cp_q", "graph_halo", "pp_p2p")
"""Ulysses sequence <-> head all-to-alls; context parallelism's key/value chunks and their
gradients around the ring (``context.py``), and its queries, partial outputs and query
gradients within a Mesh-Attention tile row; halo rows and their gradients between graph
partitions; stage activations and gradients between pipeline ranks (point-to-point, ``p2p.py``)."""


class CommCounter:
    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.enabled = False

    def record(self, kind: str, sent_bytes: int) -> None:
        if self.enabled:
            self.bytes[kind] += sent_bytes
            self.calls[kind] += 1

    @contextmanager
    def measure(self) -> Iterator[CommCounter]:
        """Count from zero inside the block."""
        self.bytes.clear()
        self.calls.clear()
        self.enabled = True
        try:
            yield self
        finally:
            self.enabled = False


COMM_COUNTER = CommCounter()
"""The process-wide counter the engine's collectives report to."""
