"""adaLN modulation with per-sample tables over a packed row, without per-token copies.

Wan broadcasts one shift/scale/gate vector per batch element over its tokens; a packed row holds
several samples, so each token reads its sample's row of an ``[n, D]`` table. Written as
``table[index]`` this materialises a ``[T, D]`` fp32 copy per vector, which autograd keeps for
backward (four per block: 24 KiB per token at Wan 1.3B's width, 5.8 GB over 30 blocks at 7,800
tokens), and whose backward is an ``index_put`` with accumulation: on CUDA a sort whose runs of
equal indices (every token of a sample) are summed serially. These functions keep only the
``[n, D]`` tables, broadcast them when the row is one sample (no gather at all, exactly Wan's
computation), and reduce the tables' gradients with a sum (one sample) or an ``index_add``.
Forward values are those of ``table[index]``; gradients equal up to fp32 summation order.
"""

from __future__ import annotations

import torch


def _per_token(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return table if table.shape[0] == 1 else table.index_select(0, index)


def _per_sample_sum(values: torch.Tensor, index: torch.Tensor, samples: int) -> torch.Tensor:
    if samples == 1:
        return values.sum(0, keepdim=True)
    return values.new_zeros(samples, values.shape[1]).index_add_(0, index, values)


class _Modulate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, shift, index):
        ctx.save_for_backward(x, scale, index)
        return x * (1 + _per_token(scale, index)) + _per_token(shift, index)

    @staticmethod
    def backward(ctx, grad):
        x, scale, index = ctx.saved_tensors
        samples = scale.shape[0]
        return (grad * (1 + _per_token(scale, index)), _per_sample_sum(grad * x, index, samples),
                _per_sample_sum(grad, index, samples), None)


class _GatedAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, residual, branch, gate, index):
        ctx.save_for_backward(branch, gate, index)
        return residual + branch * _per_token(gate, index)

    @staticmethod
    def backward(ctx, grad):
        branch, gate, index = ctx.saved_tensors
        grad_branch = (grad * _per_token(gate, index)).to(branch.dtype)
        return grad, grad_branch, _per_sample_sum(grad * branch, index, gate.shape[0]), None


def modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x * (1 + scale[index]) + shift[index]``: ``x`` [T, D], tables [n, D], ``index`` [T] in [0, n)."""
    return _Modulate.apply(x, scale, shift, index)


def gated_add(residual: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``residual + branch * gate[index]``: ``residual`` and ``branch`` [T, D], ``gate`` [n, D]."""
    return _GatedAdd.apply(residual, branch, gate, index)
