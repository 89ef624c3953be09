"""Per-step mixture-of-experts bookkeeping: auxiliary losses, expert load, router bias updates.

The model only records what its latest forward saw (``moe_aux_loss()``, ``moe_load()``) and
knows how to apply a bias update (``update_router_bias``); the engine does the communication.
Loads are summed over the step's micro-batches and reduced over the data-parallel ranks once
per step, so the auxiliary-loss-free bias update is identical on every rank, and the metrics
describe the whole global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class MoEStepStats:
    """One optimizer step's MoE statistics; ``None`` from ``for_model`` for dense models."""

    def __init__(self, model: nn.Module, micro_batches: int) -> None:
        self.model = model
        self.micro_batches = micro_batches
        self.load: torch.Tensor | None = None
        self.aux_sum = 0.0

    @classmethod
    def for_model(cls, model: nn.Module, micro_batches: int) -> MoEStepStats | None:
        has_moe = callable(getattr(model, "moe_layers", None)) and model.moe_layers()
        return cls(model, micro_batches) if has_moe else None

    def aux_loss(self) -> torch.Tensor | None:
        """The latest forward's auxiliary losses (this rank's share of the global value), to be
        added to the objective with weight ``loss_size / micro_batches`` like the token losses."""
        aux = self.model.moe_aux_loss()
        if aux is not None:
            self.aux_sum += float(aux.detach())
        return aux

    def record(self) -> None:
        """Add the latest forward's per-layer, per-expert token counts (call after each micro-batch)."""
        load = self.model.moe_load().detach().to(torch.float64)
        self.load = load if self.load is None else self.load + load

    def finish(self, loss_group: dist.ProcessGroup) -> dict[str, object]:
        """Reduce the step's loads over the data-parallel ranks, apply the router bias update,
        return the metrics (``moe/...``)."""
        aux = torch.tensor([self.aux_sum], dtype=torch.float64, device=self.load.device)
        packed = torch.cat([self.load.flatten(), aux])
        dist.all_reduce(packed, group=loss_group)
        load, aux = packed[:-1].view_as(self.load), float(packed[-1])
        delta = self.model.update_router_bias(load)
        imbalance = load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-9)
        metrics: dict[str, object] = {
            "moe/aux_loss": aux / self.micro_batches,
            "moe/load_max_over_mean": float(imbalance.max()),
            "moe/load_max_over_mean_per_layer": [round(float(v), 4) for v in imbalance],
            "moe/tokens_per_expert": load.to(torch.int64).tolist(),
            "moe/idle_experts": int((load == 0).sum()),
            "moe/bias_update_abs_mean": float(delta.abs().mean()),
        }
        return metrics
