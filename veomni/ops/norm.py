"""RMSNorm with Hugging Face Llama/Qwen numerics.

HF normalises in fp32 and casts back to the input dtype *before* multiplying by the weight.
``torch.nn.RMSNorm`` multiplies in a different order, which changes bf16 results by an ulp;
matching HF exactly keeps imported checkpoints bit-compatible with their reference logits.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * (x / rms(x))`` with the reduction done in fp32 (fp64 for float64 inputs)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32, or fp64 for float64 checks
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
