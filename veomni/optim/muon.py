"""Muon: momentum orthogonalised by a Newton-Schulz iteration, for hidden matrices.

Keller Jordan's quintic iteration (coefficients (3.4445, -4.7750, 2.0315), 5 steps) on the
Nesterov momentum, decoupled weight decay, and a per-matrix update scale: ``original``
sqrt(max(1, A/B)) or Moonlight's ``match_rms_adamw`` 0.2 sqrt(max(A, B)), which lets Muon reuse
AdamW's learning rate. A 2-D weight is one matrix; a 3-D tensor (grouped experts, [E, A, B]) is E
matrices, each orthogonalised and scaled on its own.

The step is the arithmetic of ``torch.optim.Muon`` (same operations in the same order, so with
``ns_dtype="bf16"`` the results are equal bit for bit); it adds the fp32 iteration on CPU (no fast
bf16 matmul there), 3-D tensors, and one seam: ``orthogonalize``, which maps the step's momentum
updates to their orthogonalised versions. On one process it runs the iteration on each tensor;
sharded parameters (FSDP2 DTensors) need whole matrices, which ``muon_sharded.py`` gathers to
owner ranks by a balanced plan (``muon_plan.py``); the registered ``muon`` always installs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

KELLER_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR = ("original", "match_rms_adamw", "none")
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def newton_schulz(matrix: Tensor, coefficients: Sequence[float], steps: int, eps: float, dtype: torch.dtype
                  ) -> Tensor:
    """The orthogonalised ``matrix`` (2-D): ``steps`` quintic iterations in ``dtype`` on the
    wide orientation, after scaling the Frobenius norm to at most 1."""
    a, b, c = coefficients
    x = matrix.to(dtype)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def orthogonalize_tensor(update: Tensor, group: dict[str, Any]) -> Tensor:
    """``newton_schulz`` of a 2-D update, or of each matrix of a 3-D one, with ``group``'s options."""
    dtype = ns_dtype(group["ns_dtype"], update.device)
    args = (group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
    if update.ndim == 2:
        return newton_schulz(update, *args)
    if update.shape[0] == 0:  # a rank that holds none of the stack's experts
        return update.to(dtype)
    return torch.stack([newton_schulz(matrix, *args) for matrix in update])


def ns_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on an accelerator, fp32 on CPU."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return NS_DTYPES[name]


def update_scale(shape: Sequence[int], adjust_lr: str) -> float:
    """The learning-rate multiplier of a matrix of ``shape`` [..., A, B]."""
    rows, cols = shape[-2], shape[-1]
    if adjust_lr == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


def local_orthogonalize(params: list[Tensor], updates: list[Tensor], group: dict[str, Any]) -> list[Tensor]:
    """One process holds whole matrices: the iteration on each update."""
    return [orthogonalize_tensor(update, group) for update in updates]


Orthogonalizer = Callable[[list[Tensor], list[Tensor], dict[str, Any]], list[Tensor]]


class Muon(torch.optim.Optimizer):
    """Muon over 2-D and 3-D parameters (see the module docstring); ``orthogonalize`` is the seam a
    sharded layout replaces."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: Sequence[float] = KELLER_COEFFICIENTS, eps: float = 1e-7,
                 ns_steps: int = 5, adjust_lr: str = "original", ns_dtype: str = "auto",
                 orthogonalize: Orthogonalizer = local_orthogonalize) -> None:
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"Muon adjust_lr {adjust_lr!r} is not one of {', '.join(ADJUST_LR)}")
        if ns_dtype not in ("auto", *NS_DTYPES):
            raise ValueError(f"Muon ns_dtype {ns_dtype!r} is not one of auto, {', '.join(NS_DTYPES)}")
        if len(ns_coefficients) != 3 or ns_steps < 1:
            raise ValueError("Muon needs three Newton-Schulz coefficients and ns_steps >= 1")
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "ns_coefficients": tuple(ns_coefficients), "eps": eps, "ns_steps": ns_steps,
                    "adjust_lr": adjust_lr, "ns_dtype": ns_dtype}
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(f"Muon takes 2-D matrices and 3-D stacks of them (grouped experts); group "
                                     f"{group.get('group', '?')!r} holds a parameter of shape {tuple(p.shape)}: "
                                     "give it to another optimizer (optim.groups)")
        self.orthogonalize = orthogonalize

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            momentum = group["momentum"]
            updates = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                updates.append(p.grad.lerp(buf, momentum) if group["nesterov"] else buf)
            for p, update in zip(params, self.orthogonalize(params, updates, group)):
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"] * update_scale(p.shape, group["adjust_lr"]))
        return loss
