"""Device-independent costs of a computation: bytes autograd saves for backward, aten ops run.

Both are counts, not timings, so they mean the same on a loaded 2-core CPU as on a GPU: the CPU
guards of ``tests/ops/test_block_costs.py`` and ``scripts/profile_cpu.py`` compare them against the
reference models (transformers, diffusers) to catch what makes a GPU step slower or larger than
theirs: activations kept per token (memory, and the traffic to write and read them), and extra
kernels (each a launch and a pass over memory on a GPU).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def saved_bytes(run: Callable[[], torch.Tensor], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd keeps for backward while ``run()`` builds its graph
    (what it returns is dropped). Storages of ``exclude`` (the weights, which exist anyway) are
    not counted; a storage saved by several ops counts once."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(seen.values())


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def aten_ops(run: Callable[[], object]) -> Counter[str]:
    """How many times each aten op (by name, e.g. ``aten.mm``) runs in ``run()``, backward
    included when ``run`` calls it (autograd runs it under the caller's dispatch mode)."""
    counter = _OpCounter()
    with counter:
        run()
    return counter.counts
