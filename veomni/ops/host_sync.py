"""Count the places where a computation waits for the device: host synchronisations.

On a GPU, reading a tensor's value on the host (``.item()``, ``.tolist()``, ``int()`` /
``bool()`` / ``float()`` of a tensor) or running an op whose output shape depends on the data
(``nonzero``, boolean masking, ``unique``, ``repeat_interleave`` without ``output_size``,
``bincount``) stops the CPU until the GPU has caught up, so the kernel queue runs dry and the
GPU idles. On a CPU nothing waits, so such calls cost nothing there and slip in unnoticed;
``HostSyncCounter`` records them on any device, which lets a CPU test keep a training step free
of them. ``torch.compile(fullgraph=True)`` refuses most of them too, for the same reason.

It sees ops through a dispatch mode (what reaches aten: scalar reads, data-dependent shapes) and
a function mode (``Tensor.tolist``, which reads memory without dispatching an op). A copy of a
CUDA tensor to the CPU (``.cpu()``) is invisible on a CPU-only machine: every tensor is there.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_SYNCING_OPS = {
    _aten._local_scalar_dense.default: "scalar read (.item() / int() / bool() / float())",
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten.bincount.default: "bincount (output size is max + 1)",
    _aten._unique2.default: "unique",
    _aten.unique_dim.default: "unique",
    _aten.unique_consecutive.default: "unique_consecutive",
    _aten.equal.default: "torch.equal",
}
_TORCH_DIR = str(Path(torch.__file__).parent)


@dataclass(frozen=True)
class HostSync:
    """One host synchronisation: what it was and the innermost frame outside torch that caused it."""

    kind: str
    function: str
    where: str

    def __str__(self) -> str:
        return f"{self.kind} in {self.function} ({self.where})"


def _caller() -> tuple[str, str]:
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_TORCH_DIR) and frame.filename != __file__:
            return frame.name, f"{frame.filename}:{frame.lineno}"
    return "?", "?"


def _sync_kind(func, args, kwargs) -> str | None:
    if func in _SYNCING_OPS:
        return _SYNCING_OPS[func]
    if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size"
    if func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default):
        indices = args[1]
        if any(i is not None and i.dtype == torch.bool for i in indices):
            return "boolean mask indexing"
    return None


class _DispatchProbe(TorchDispatchMode):
    def __init__(self, found: list[HostSync]) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _sync_kind(func, args, kwargs)
        if kind is not None:
            self.found.append(HostSync(kind, *_caller()))
        return func(*args, **kwargs)


class _FunctionProbe(TorchFunctionMode):
    def __init__(self, found: list[HostSync]) -> None:
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            self.found.append(HostSync("tolist", *_caller()))
        return func(*args, **(kwargs or {}))


class HostSyncCounter:
    """``with HostSyncCounter() as syncs: ...`` then ``syncs.found``: every host synchronisation
    of the block, forward and backward (autograd runs the backward under the caller's modes)."""

    def __init__(self) -> None:
        self.found: list[HostSync] = []
        self._modes = (_FunctionProbe(self.found), _DispatchProbe(self.found))

    def __enter__(self) -> HostSyncCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def outside(self, allowed: dict[str, str]) -> list[HostSync]:
        """The syncs whose function is not a key of ``allowed`` (function name -> why it must sync)."""
        return [sync for sync in self.found if sync.function not in allowed]
