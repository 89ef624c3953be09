"""``models/dit/modulation.py`` computes what the per-token gathers computed, values and gradients."""

from __future__ import annotations

import pytest
import torch

from models.dit.modulation import gated_add, modulate


@pytest.mark.parametrize("samples", [1, 3])
def test_modulate_and_gated_add_equal_the_gather_form(samples):
    gen = torch.Generator().manual_seed(0)
    tokens, dim = 10, 6
    index = torch.sort(torch.randint(0, samples, (tokens,), generator=gen)).values
    x, residual = (torch.randn(tokens, dim, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    branch = torch.randn(tokens, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    scale, shift, gate = (torch.randn(samples, dim, generator=gen, dtype=torch.float64, requires_grad=True)
                          for _ in range(3))
    inputs = (x, residual, branch, scale, shift, gate)

    def ours():
        return gated_add(residual, modulate(x, scale, shift, index) * branch, gate, index)

    def gathered():
        return residual + (x * (1 + scale[index]) + shift[index]) * branch * gate[index]

    torch.testing.assert_close(ours(), gathered(), rtol=0, atol=0)
    weights = torch.randn(tokens, dim, generator=gen, dtype=torch.float64)
    expected = torch.autograd.grad((gathered() * weights).sum(), inputs)
    got = torch.autograd.grad((ours() * weights).sum(), inputs)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
