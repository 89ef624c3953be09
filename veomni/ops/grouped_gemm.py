"""Grouped GEMM for mixture-of-experts: rows sorted by expert times one weight per expert.

``grouped_mm(x, w, counts)`` multiplies the first ``counts[0]`` rows of ``x`` by ``w[0]``, the
next ``counts[1]`` by ``w[1]``, and so on. PyTorch's ``torch.nn.functional.grouped_mm`` does
this in one kernel where the build has it and the operands meet its layout rule (every stride
a multiple of 16 bytes); otherwise one ``mm`` per non-empty segment, which is exact and still
much cheaper than the naive loop that masks the whole batch once per expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ALIGN_BYTES = 16


def _aligned(*tensors: torch.Tensor) -> bool:
    """Every stride a multiple of 16 bytes, and the data too; a compiled graph has no data address
    to check, but the storages it passes (its own buffers, whole weights) start aligned."""
    return all(
        (torch.compiler.is_compiling() or t.data_ptr() % _ALIGN_BYTES == 0)
        and all((s * t.element_size()) % _ALIGN_BYTES == 0 for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1)
        for t in tensors
    )


def has_fused_grouped_mm() -> bool:
    """True when this PyTorch build exposes the fused grouped matmul."""
    return hasattr(F, "grouped_mm")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """``x`` [N, K] with rows grouped by expert, ``w`` [E, K, M], ``counts`` [E] summing to N -> [N, M].

    ``fused=None`` picks the fused kernel when available and applicable; ``False`` forces the
    segment loop (used by the benchmark and the tests that compare both paths).
    """
    if fused is None:
        fused = has_fused_grouped_mm() and x.shape[0] > 0 and _aligned(x, w)
    if fused:
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return F.grouped_mm(x, w, offs=offs)
    sizes = counts.tolist()
    # split/unbind (not x[a:b], w[e]): their backward is one cat/stack, where per-segment slicing
    # would materialise a zero-filled full-size gradient per expert.
    pieces = [a @ b for a, b, size in zip(torch.split(x, sizes), w.unbind(0), sizes) if size]
    if not pieces:
        # No rows: still a (zero) function of w, so its gradient is zeros rather than None and
        # every rank's FSDP reduce-scatter of the expert weights has something to reduce.
        return x @ w[0]
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]
