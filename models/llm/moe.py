"""Mixture-of-experts feed-forward: top-k router, grouped SwiGLU experts, optional shared expert.

Plain single-device PyTorch. Two injection points carry every cross-device concern, each
with a single-device default that the engine replaces (``veomni/parallel/expert.py``):

- ``dispatcher(x, expert_idx, weights, experts) -> y``: moves token rows to the experts and
  the results back. The default sorts rows by expert and runs one grouped GEMM.
- ``reduce_load(counts) -> counts``: sums per-expert token counts over every data-parallel
  rank. The load-balancing loss needs the *global* load so that its value and gradient do
  not depend on how the batch is split across ranks (identity on one device).

The layer keeps the statistics of its latest forward (``last_load``, ``last_aux``) for the
engine to read: it adds the auxiliary losses to the objective, reduces the loads once per
step and then calls ``update_bias`` (the auxiliary-loss-free method of DeepSeek-V3), so every
rank applies the same update without the model doing any communication.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from veomni.contract.hooks import MoEHooks
from veomni.ops.grouped_gemm import grouped_mm

from .config import LLMConfig


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts stored grouped, in the HF Qwen-MoE layout.

    gate_up_proj [E, 2I, H] (gate rows first, then up rows) and down_proj [E, H, I]: the
    leading expert dim is the one expert parallelism shards. ``local_weight`` is an injection
    point: expert parallelism sets it to return this rank's slice of a sharded weight; it is
    applied inside ``forward`` so that it sees the weights as FSDP gathered them. ``expert_delta``
    is another (``veomni.contract.hooks.AdaptableExperts``): LoRA adds its per-expert low-rank update
    to each projection through it.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.local_weight: Callable[[torch.Tensor], torch.Tensor] = _identity
        self.expert_delta: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def expert_count(self) -> int:
        """Experts in the group, whole (``veomni.contract.hooks.ExpertGroup``)."""
        return self.gate_up_proj.shape[0]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of ``x`` sorted by expert, ``counts[e]`` rows for (local) expert ``e``."""
        gate, up = self._project("gate_up_proj", x, counts).chunk(2, dim=-1)
        return self._project("down_proj", F.silu(gate) * up, counts)

    def _project(self, name: str, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = grouped_mm(x, self.local_weight(getattr(self, name)).transpose(1, 2), counts)
        return out if self.expert_delta is None else out + self.expert_delta(name, x, counts)


class Dispatcher(Protocol):
    def __call__(self, x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor: ...


def count_per_expert(expert_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] how many of the assignments ``expert_idx`` (any shape, values in [0, E)) land on each
    expert. A scatter-add, not ``bincount``: bincount's output size is the data's max + 1, which
    a GPU must read back to the host (a sync per call)."""
    flat = expert_idx.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def sort_by_expert(expert_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): ``order`` sorts the flattened [T*k] assignments by expert (stable, so
    ties keep token order), ``counts`` [E] is how many land on each expert."""
    flat = expert_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, count_per_expert(flat, num_experts)


def local_dispatch(x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor,
                   experts: GroupedExperts) -> torch.Tensor:
    """Single-device dispatch: gather rows sorted by expert, grouped GEMM, weighted scatter-add.

    ``expert_idx`` [T, k] may hold -1 for assignments dropped by the capacity limit. Those still
    run through the last expert and are then masked out: every row count stays ``T * k``, known
    without reading the counts back to the host, at the price of the dropped rows' FLOPs.
    """
    num_experts = experts.gate_up_proj.shape[0]
    k = expert_idx.shape[1]
    kept = expert_idx >= 0
    order, counts = sort_by_expert(expert_idx.masked_fill(~kept, num_experts - 1), num_experts)
    token = order // k
    y = experts(x[token], counts)
    y = torch.where(kept.reshape(-1)[order, None], y * weights.reshape(-1)[order, None].to(y.dtype), 0.0)
    return torch.zeros_like(x).index_add(0, token, y)


class Router(nn.Module):
    """Linear scores over experts, top-k selection, optional bias used only for selection."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.top_k = cfg.num_experts_per_tok
        self.scoring = cfg.router_scoring
        self.norm_topk = cfg.norm_topk_prob
        self.scale = cfg.routed_scaling_factor
        # DeepSeek-V3's e_score_correction_bias: steers selection only, never the weights.
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts), persistent=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits [T,E], probs [T,E] fp32, expert_idx [T,k], weights [T,k] fp32)."""
        logits = F.linear(x, self.weight)
        if self.scoring == "softmax":
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            probs = torch.sigmoid(logits.float())
        _, expert_idx = torch.topk(probs + self.expert_bias, self.top_k, dim=-1)
        weights = probs.gather(1, expert_idx)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        return logits, probs, expert_idx, weights * self.scale


class MoE(nn.Module):
    """Routed experts (+ an optional shared SwiGLU expert) replacing the dense MLP."""

    def __init__(self, cfg: LLMConfig, shared_mlp: nn.Module | None) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = shared_mlp
        self.shared_expert_gate = (nn.Linear(cfg.hidden_size, 1, bias=False)
                                   if shared_mlp is not None and cfg.shared_expert_gate else None)
        self.aux_loss_coef, self.z_loss_coef = cfg.router_aux_loss_coef, cfg.router_z_loss_coef
        self.bias_update_rate = cfg.router_bias_update_rate
        self.capacity_factor = cfg.capacity_factor
        self.dispatcher: Dispatcher = local_dispatch
        self.reduce_load = _identity
        self.last_load: torch.Tensor | None = None
        self.last_aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, valid_tokens: int | None = None) -> torch.Tensor:
        """Rows from ``valid_tokens`` on are padding (a sequence-parallel slice or pipeline row
        filled up to a fixed size; ``None`` = no padding): they get no routed expert and count
        in neither the expert loads, the capacity, nor the auxiliary losses, so padding changes
        no statistic. Their output is only the shared expert's (they carry no loss)."""
        tokens = x.shape[0]
        if valid_tokens is None or valid_tokens >= tokens:
            out = self._routed(x)
        else:
            out = F.pad(self._routed(x[:valid_tokens]), (0, 0, 0, tokens - valid_tokens))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted output for every row of ``x``; records the statistics."""
        logits, probs, expert_idx, weights = self.router(x)
        load = count_per_expert(expert_idx, self.num_experts)
        self.last_load = load
        self.last_aux = self._aux_losses(logits, probs, load)
        if self.capacity_factor > 0:
            expert_idx = self._drop_over_capacity(expert_idx)
        return self.dispatcher(x, expert_idx, weights, self.experts)

    def _aux_losses(self, logits: torch.Tensor, probs: torch.Tensor, load: torch.Tensor) -> torch.Tensor | None:
        """This rank's share of the layer's auxiliary losses, normalised by *global* counts.

        Load balance (Switch / GShard): ``coef * E * sum_e f_e * P_e`` with ``f_e`` the global
        fraction of assignments to ``e`` (no gradient) and ``P_e`` the mean router probability
        over all global tokens. This rank contributes ``P_e``'s sum over its own tokens, so the
        contributions of all ranks add up to the loss of the whole global micro-batch.
        z-loss (ST-MoE): ``coef * mean_t logsumexp(logits_t)^2``, split across ranks the same way.
        """
        if not (self.aux_loss_coef or self.z_loss_coef):
            return None
        global_load = self.reduce_load(load.float())
        global_tokens = (global_load.sum() / self.top_k).clamp_min(1.0)
        total = logits.new_zeros((), dtype=torch.float32)
        if self.aux_loss_coef:
            scores = probs if self.router.scoring == "softmax" else probs / probs.sum(-1, keepdim=True)
            fraction = global_load / (global_tokens * self.top_k)
            total = total + self.aux_loss_coef * self.num_experts * (fraction * scores.sum(0)).sum() / global_tokens
        if self.z_loss_coef:
            z = torch.logsumexp(logits.float(), dim=-1).pow(2).sum()
            total = total + self.z_loss_coef * z / global_tokens
        return total

    def _drop_over_capacity(self, expert_idx: torch.Tensor) -> torch.Tensor:
        """Mark assignments beyond ``ceil(capacity_factor * T * k / E)`` per expert as -1,
        first come first served in token order (capacity is per rank and micro-batch)."""
        capacity = math.ceil(self.capacity_factor * expert_idx.numel() / self.num_experts)
        flat = expert_idx.reshape(-1)
        one_hot = F.one_hot(flat, self.num_experts)
        position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1
        return flat.masked_fill(position >= capacity, -1).view_as(expert_idx)

    @torch.no_grad()
    def update_bias(self, global_load: torch.Tensor) -> torch.Tensor:
        """Auxiliary-loss-free balancing: ``bias_e += rate * sign(mean load - load_e)``.

        ``global_load`` must be the load summed over the step and all ranks, so the update is
        identical everywhere. Returns the applied update (zeros when the method is off).
        """
        if not self.bias_update_rate:
            return torch.zeros_like(self.router.expert_bias)
        load = global_load.to(self.router.expert_bias)
        delta = self.bias_update_rate * torch.sign(load.mean() - load)
        self.router.expert_bias.add_(delta)
        return delta


class MoEHost(MoEHooks):
    """What the engine reads from a model with MoE layers after each forward (``moe_stats.py``),
    shared by every model family whose blocks may hold ``MoE`` FFNs (DecoderLM, VWN)."""

    def moe_layers(self) -> list[MoE]:
        """The MoE blocks in module order (found through any wrapper the engine added)."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    def moe_aux_loss(self) -> torch.Tensor | None:
        """Sum over layers of this rank's share of the latest forward's auxiliary losses."""
        losses = [m.last_aux for m in self.moe_layers() if m.last_aux is not None]
        return torch.stack(losses).sum() if losses else None

    def moe_load(self) -> torch.Tensor | None:
        """[layers, experts] tokens routed to each expert by the latest forward on this rank."""
        layers = self.moe_layers()
        return torch.stack([m.last_load for m in layers]) if layers else None

    def update_router_bias(self, global_load: torch.Tensor) -> torch.Tensor:
        """Apply the auxiliary-loss-free bias update from the step's global [layers, experts]
        load; returns the [layers, experts] updates applied."""
        return torch.stack([m.update_bias(load) for m, load in zip(self.moe_layers(), global_load)])

    def activated_params(self) -> int:
        """Parameters a token touches: all of them minus, in every MoE layer, the ``E - k`` routed
        experts it skips (the "A3B" of Qwen3-30B-A3B; embeddings included, as Qwen counts)."""
        skipped = sum(sum(p.numel() for p in m.experts.parameters()) * (m.num_experts - m.top_k)
                      // m.num_experts for m in self.moe_layers())
        return sum(p.numel() for p in self.parameters()) - skipped
