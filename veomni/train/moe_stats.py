"""Per-step mixture-of-experts bookkeeping: auxiliary losses, expert load, router bias updates.

The model only records what its latest forward saw (``moe_aux_loss()``, ``moe_load()``) and
knows how to apply a bias update (``update_router_bias``); the engine does the communication.
Loads are summed over the step's micro-batches and reduced over the data-parallel ranks once
per step, so the auxiliary-loss-free bias update is identical on every rank, and the metrics
describe the whole global batch. Under pipeline parallelism (``PipelineMoEStats``) each stage
does this for its own layers, and the stages' figures are gathered for the metrics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from veomni.contract.hooks import has_moe


class MoEStepStats:
    """One optimizer step's MoE statistics; ``None`` from ``for_model`` for dense models."""

    def __init__(self, model: nn.Module, micro_batches: int) -> None:
        self.model = model
        self.micro_batches = micro_batches
        self.load: torch.Tensor | None = None
        self.aux_sum = 0.0

    @classmethod
    def for_model(cls, model: nn.Module, micro_batches: int) -> MoEStepStats | None:
        return cls(model, micro_batches) if has_moe(model) else None

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

    def reduce_and_update(self, loss_group: dist.ProcessGroup) -> tuple[torch.Tensor, float, torch.Tensor]:
        """Reduce the step's loads and auxiliary-loss sum over the data-parallel ranks and apply
        the router bias update: (global load [layers, experts], global aux sum, bias updates)."""
        aux = torch.tensor([self.aux_sum], dtype=torch.float64, device=self.load.device)
        packed = torch.cat([self.load.flatten(), aux])
        dist.all_reduce(packed, group=loss_group)
        load, aux_sum = packed[:-1].view_as(self.load), float(packed[-1])
        return load, aux_sum, self.model.update_router_bias(load)

    def finish(self, loss_group: dist.ProcessGroup) -> dict[str, object]:
        """``reduce_and_update``, then the metrics (``moe/...``)."""
        load, aux_sum, delta = self.reduce_and_update(loss_group)
        return moe_metrics(load, aux_sum / self.micro_batches, delta)


def moe_metrics(load: torch.Tensor, aux_loss: float, delta: torch.Tensor) -> dict[str, object]:
    """The step's ``moe/...`` metrics from its global [layers, experts] load, mean auxiliary
    loss per micro-batch and router bias updates."""
    imbalance = load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-9)
    return {
        "moe/aux_loss": aux_loss,
        "moe/load_max_over_mean": float(imbalance.max()),
        "moe/load_max_over_mean_per_layer": [round(float(v), 4) for v in imbalance],
        "moe/tokens_per_expert": load.to(torch.int64).tolist(),
        "moe/idle_experts": int((load == 0).sum()),
        "moe/bias_update_abs_mean": float(delta.abs().mean()),
    }


class _JoinAuxLoss(torch.autograd.Function):
    """Returns the stage output unchanged; in backward also gives the stage's auxiliary loss
    the gradient ``weight``, as if it had been added to a loss with that weight. Stages other
    than the last have no loss function, so this is how their MoE losses join backward."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight, ctx.aux_dtype = weight, aux.dtype
        # Not a view (``view_as``): the zero-bubble schedules detach stage outputs in place.
        return output.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full((), ctx.weight, dtype=ctx.aux_dtype, device=grad.device), None


class PipelineMoEStats:
    """One step's MoE bookkeeping under pipeline parallelism: the stage-output hook of
    ``Pipeline.step``, with one ``MoEStepStats`` per stage module of this rank.

    After each training forward of a stage (the schedule runs them all inside the step) the
    hook adds the stage's expert loads to the step's sum and joins its auxiliary losses to
    backward with weight ``loss_size / micro_batches``, as ``step.forward_backward`` does (the
    pipeline's loss function carries the token-loss scale, and runs with ``scale_grads=False``).
    """

    def __init__(self, parts: list[nn.Module], stage_indices: list[int], micro_batches: int,
                 loss_size: int) -> None:
        self.micro_batches = micro_batches
        self.weight = loss_size / micro_batches
        self.stats = {id(part): (index, MoEStepStats.for_model(part, micro_batches))
                      for part, index in zip(parts, stage_indices)}

    def __call__(self, part: nn.Module, output: torch.Tensor) -> torch.Tensor:
        stats = self.stats[id(part)][1]
        if stats is None:  # a stage without MoE layers
            return output
        aux = stats.aux_loss()
        stats.record()
        return output if aux is None else _JoinAuxLoss.apply(output, aux, self.weight)

    def finish(self, loss_group: dist.ProcessGroup, pp_group: dist.ProcessGroup) -> dict[str, object]:
        """Reduce each stage's loads over dp x sp and update its router biases (each stage owns
        its own layers); then gather every stage's figures over the pipeline, in stage order, so
        the metrics cover all layers in model order as without pipelining (one small object
        gather per step)."""
        mine = {}
        for index, stats in self.stats.values():
            if stats is not None:
                load, aux_sum, delta = stats.reduce_and_update(loss_group)
                mine[index] = (load.cpu(), aux_sum, delta.cpu())
        gathered: list[dict | None] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(gathered, mine, group=pp_group)
        stages = [v for _, v in sorted(((i, v) for part in gathered for i, v in part.items()), key=lambda kv: kv[0])]
        load = torch.cat([load for load, _, _ in stages])
        delta = torch.cat([delta for _, _, delta in stages])
        return moe_metrics(load, sum(aux for _, aux, _ in stages) / self.micro_batches, delta)
