"""Dynamic generalized hyper-connection (DGHC), VWN paper Sec. 3.3 and Algorithm 2.

The wide state of one token is n slots of width d = D/m. Around a block T (attention or FFN,
pre-norm inside):

    X  = Å^T H'                 read: n slots -> m blocks = the block's D-wide input
    H' <- B^T reshape(T(X)) + Â^T H'    write the block output into slots, carry the state

with token-dependent maps (norm = RMSNorm over each slot, tau = sqrt(d)):

    A(H') = S_a * tanh(norm(H') W_a / tau) + A      A = [Å | Â]  (n x (m+n))
    B(H') = S_b * tanh(norm(H') W_b / tau)^T + B    B (m x n), stored transposed (n x m)

Initialisation: W = 0, S = 1 (the VWN paper; HC used a scalar 0.01), B[i, j] = [i == j mod m],
A = [[I_m, I_m, 0], [0, 0, I_{n-m}]], so Å reads the first m slots and Â = I_n: at n == m the
block is exactly a pre-norm residual block.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from veomni.ops.norm import RMSNorm


def static_alpha(m: int, n: int) -> torch.Tensor:
    """A = [Å | Â] at initialisation, shape (n, m+n)."""
    alpha = torch.zeros(n, m + n)
    alpha[:m, :m] = torch.eye(m)
    alpha[:, m:] = torch.eye(n)
    return alpha


def static_beta(m: int, n: int) -> torch.Tensor:
    """B^T at initialisation, shape (n, m): slot j receives output block j mod m."""
    beta = torch.zeros(n, m)
    beta[torch.arange(n), torch.arange(n) % m] = 1.0
    return beta


class GeneralizedHyperConnection(nn.Module):
    """One DGHC: ``read`` gives the block input (and what ``write`` needs), ``write`` folds back."""

    STATIC = ("static_alpha", "static_beta")
    """Parameter names of the static maps (no weight decay in the paper)."""

    def __init__(self, hidden_size: int, m: int, n: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.m, self.n, self.d = m, n, hidden_size // m
        self.scale = 1.0 / math.sqrt(self.d)  # 1 / tau
        self.static_alpha = nn.Parameter(static_alpha(m, n))
        self.static_beta = nn.Parameter(static_beta(m, n))
        self.dynamic_alpha = nn.Parameter(torch.zeros(self.d, m + n))  # W_a
        self.dynamic_beta = nn.Parameter(torch.zeros(self.d, m))  # W_b
        self.alpha_scale = nn.Parameter(torch.ones(n, m + n))  # S_a
        self.beta_scale = nn.Parameter(torch.ones(n, m))  # S_b^T
        self.norm = RMSNorm(self.d, eps)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The paper's initialisation (see the module docstring)."""
        self.static_alpha.copy_(static_alpha(self.m, self.n))
        self.static_beta.copy_(static_beta(self.m, self.n))
        self.dynamic_alpha.zero_()
        self.dynamic_beta.zero_()
        self.alpha_scale.fill_(1.0)
        self.beta_scale.fill_(1.0)
        self.norm.reset_parameters()

    def read(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Wide state ``h`` [T, n*d] -> (block input [T, D], carry Â^T H' [T, n, d], B^T [T, n, m]).

        The dynamic maps for alpha and beta come from one fused projection, as in Algorithm 2.
        """
        slots = h.reshape(h.shape[0], self.n, self.d)
        weight = torch.cat([self.dynamic_alpha, self.dynamic_beta], dim=1)
        dynamic = torch.tanh(self.norm(slots) @ weight * self.scale)  # [T, n, 2m+n]
        maps = dynamic * torch.cat([self.alpha_scale, self.beta_scale], dim=1) + torch.cat(
            [self.static_alpha, self.static_beta], dim=1)
        alpha, beta = maps.split((self.m + self.n, self.m), dim=-1)
        mixed = torch.einsum("tjd,tjk->tkd", slots, alpha)  # [T, m+n, d] = A^T H'
        block_input = mixed[:, : self.m].reshape(h.shape[0], self.m * self.d)
        return block_input, mixed[:, self.m :], beta

    def write(self, out: torch.Tensor, carry: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """Block output ``out`` [T, D] -> new wide state B^T out + Â^T H', [T, n*d]."""
        tokens = out.shape[0]
        written = torch.einsum("tjm,tmd->tjd", beta, out.reshape(tokens, self.m, self.d))
        # the sum is the last op, so the block returns a fresh tensor, not a view (FSDP2 hooks)
        return written.reshape(tokens, self.n * self.d) + carry.reshape(tokens, self.n * self.d)

    def forward(self, h: torch.Tensor, block: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """One hyper-connected block: read, run ``block`` at width D, write back. [T, n*d] -> [T, n*d]."""
        block_input, carry, beta = self.read(h)
        return self.write(block(block_input), carry, beta)

    def training_flops_per_token(self) -> int:
        """Matmul FLOPs of forward + backward per token (3x forward; norm and tanh not counted).

        Forward: dynamic maps 2*n*d*(2m+n), width connection 2*n*d*(m+n), depth connection
        2*n*m*d; for (m, n) = (2, 3) that is 21D + 15D + 6D, the paper's 42D + 6D less its
        norm term 4(n/m)D = 6D, which (like every element-wise op) MFU does not count.
        """
        n, m, d = self.n, self.m, self.d
        return 3 * (2 * n * d * (2 * m + n) + 2 * n * d * (m + n) + 2 * n * m * d)
