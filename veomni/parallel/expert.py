"""Expert parallelism (EP), combined with FSDP2 as in VeOmni's EP x FSDP2 recipe.

Layout. The ``dp_shard`` ranks form a 2-D mesh ``(ep_fsdp, ep)``. Along ``ep`` the experts are
split: the rank at ep index ``r`` owns experts ``[r*L, (r+1)*L)`` with ``L = E / ep``. Along
``ep_fsdp`` the ranks holding the same experts shard them further with FSDP2. Expert weights
are DTensors on the ``ep`` mesh (``Shard(0)``) before FSDP wraps them, so the parameters, their
gradients and ``get_model_state_dict`` all carry the global ``[E, ...]`` shape: checkpoints
load at any ``ep`` and HF export sees every expert.

Dispatch (``ExpertParallelDispatcher``, installed as each MoE layer's ``dispatcher``):
sort this rank's (token, expert) assignments by expert, exchange per-expert counts, send the
rows to the ranks owning their experts with an uneven ``all_to_all_single`` (differentiable),
run the local experts as one grouped GEMM, send the results back the same way, and combine
them with the router weights on the token's own rank (so the router's gradient stays local).

Gradients. Every rank's loss is scaled by ``loss_size`` (dp x sp) because FSDP averages dense
gradients over those ranks, which are also the ``ep_fsdp x ep`` ranks. An expert's gradient on one rank already sums the
contributions of all tokens of its EP group, and FSDP averages it over only the ``ep_fsdp``
ranks holding the same experts, so it would come out ``ep`` times too large: the dispatcher
scales the local expert weights' gradient by ``1 / ep`` on the way back.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from veomni.contract.hooks import expert_modules
from veomni.contract.plan import ParallelPlan, flatten_plan

logger = logging.getLogger(__name__)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class LocalExpertWeight:
    """``local_weight`` of grouped experts under EP: this rank's slice of a weight sharded over
    ``ep`` (a DTensor), differentiably, with the gradient scaled by ``1 / ep``."""

    def __init__(self, ep: int) -> None:
        self.grad_scale = 1.0 / ep

    def __call__(self, param: torch.Tensor) -> torch.Tensor:
        local = param.to_local() if isinstance(param, DTensor) else param
        return _ScaleGrad.apply(local, self.grad_scale)


class ExpertParallelDispatcher:
    """Routes token rows to the ``ep`` ranks owning their experts and brings the results back."""

    def __init__(self, ep_mesh: DeviceMesh, num_experts: int) -> None:
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.num_experts = num_experts
        self.local_experts = num_experts // self.ep

    def __call__(self, x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor,
                 experts: nn.Module) -> torch.Tensor:
        E, P, L, k = self.num_experts, self.ep, self.local_experts, expert_idx.shape[1]
        flat = expert_idx.reshape(-1)
        flat = flat.masked_fill(flat < 0, E)  # capacity-dropped assignments sort last, never sent
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E + 1)[:E]
        order = order[: int(counts.sum())]
        token = order // k

        # 1. how many rows each rank sends to each of our local experts
        recv_counts = funcol.all_to_all_single(counts, [L] * P, [L] * P, self.group).wait().view(P, L)
        send_splits = counts.view(P, L).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()

        # 2. rows out, grouped by destination rank (and by expert within it)
        received = funcol.all_to_all_single_autograd(x[token], recv_splits, send_splits, self.group)

        # 3. received rows are ordered (source rank, local expert): regroup by local expert
        local_expert = torch.arange(L, device=x.device).repeat(P).repeat_interleave(recv_counts.reshape(-1))
        perm = torch.argsort(local_expert, stable=True)
        out = experts(received[perm], recv_counts.sum(0))
        out = out[torch.argsort(perm)]

        # 4. results back to the rows' own ranks, in the order they were sent
        back = funcol.all_to_all_single_autograd(out, send_splits, recv_splits, self.group)
        back = back * weights.reshape(-1)[order, None].to(back.dtype)
        return torch.zeros_like(x).index_add(0, token, back)


class GlobalLoadReducer:
    """``reduce_load`` for every layout: per-expert counts summed over every rank holding
    tokens of the step (dp x sp)."""

    def __init__(self, loss_mesh: DeviceMesh) -> None:
        self.group = loss_mesh.get_group()

    def __call__(self, counts: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(counts, "sum", self.group).wait()


def check_expert_layout(ep: int, num_experts: int, model_name: str = "the model") -> None:
    """Config-time check: ``parallel.ep`` must split the experts evenly (ValueError otherwise). The
    messages name no config key: a family outside the zoo may count its experts under any name."""
    if ep > 1 and num_experts <= 0:
        raise ValueError(f"parallel.ep={ep} needs a mixture-of-experts model, and {model_name}'s parallel_plan() "
                         "declares no grouped experts (docs/adding_a_model.md, 'What it does not give for free'): "
                         "set parallel.ep: 1, or configure the model with experts")
    if ep > 1 and num_experts % ep:
        raise ValueError(f"parallel.ep={ep} does not divide the {num_experts} experts of {model_name}; pick a "
                         f"divisor of {num_experts}")


def check_model_experts(model: nn.Module, ep: int) -> None:
    """``check_expert_layout`` for the grouped-expert modules the (meta) model's plan declares."""
    experts = expert_modules(model, flatten_plan(model.parallel_plan()).experts)
    check_expert_layout(ep, experts[0][1].expert_count() if experts else 0, type(model).__name__)


def apply_expert_parallel(model: nn.Module, plan: ParallelPlan, ep_mesh: DeviceMesh | None,
                          loss_mesh: DeviceMesh, loss_size: int) -> list[nn.Module]:
    """Install EP dispatchers and global load reduction; shard expert weights over ``ep_mesh``.

    Must run before activation checkpointing and FSDP (they wrap what this sets up). Returns
    the grouped-expert modules, which FSDP then shards over the ``ep_fsdp`` mesh.
    """
    experts = expert_modules(model, plan.experts)  # each held by a MoELayer
    ep = ep_mesh.size() if ep_mesh is not None else 1
    if ep > 1 and not experts:
        raise ValueError(f"parallel.ep={ep} but {type(model).__name__}.parallel_plan() declares no experts "
                         "(is model.num_experts > 0?)")
    for path, module in experts:
        parent_path = path.rpartition(".")[0]
        layer = model.get_submodule(parent_path) if parent_path else model
        if loss_size > 1:
            layer.reduce_load = GlobalLoadReducer(loss_mesh)
        if ep == 1:
            continue
        num_experts = module.expert_count()
        check_expert_layout(ep, num_experts)
        layer.dispatcher = ExpertParallelDispatcher(ep_mesh, num_experts)
        module.local_weight = LocalExpertWeight(ep)
        rank, local = ep_mesh.get_local_rank(), num_experts // ep
        for name, param in list(module.named_parameters(recurse=False)):
            shard = param.detach()[rank * local:(rank + 1) * local].clone()
            sharded = DTensor.from_local(shard, ep_mesh, [Shard(0)], run_check=False)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    if experts and ep > 1:
        logger.info("expert parallel: %d MoE layers, experts sharded %d-way", len(experts), ep)
    return [module for _, module in experts] if ep > 1 else []
