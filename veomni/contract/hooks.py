"""The typed hooks the engine calls on a model family: no ``hasattr`` discovery.

- ``TrainableModel``: what every model built by a spec provides (its ``ParallelPlan`` and its
  own weight initialisation). A protocol: the zoo's models satisfy it without inheriting.
- ``ConfiguredModule``: a model or sub-module that carries its config dataclass as ``config``;
  ``checkpoint.init`` compares it with a pretrained folder's before loading into it.
- ``CostModel``: FLOPs and activation memory per unit of work, for MFU and ``--dry-run``; a
  spec carries one, so the engine never asks a model whether it has a FLOP method.
- ``MoEHooks``: the base class of models with mixture-of-experts layers; the engine's per-step
  MoE bookkeeping (aux losses, expert loads, router-bias updates) runs for instances of it.
- ``SampleWriter``: what a generative family writes during training (validation clips, images)
  for people to look at; ``train.sample_interval`` says how often.
- ``ParamRule``: optimizer options for parameters matched by name (a spec's parameter rules).

Media models' hooks (``MediaHost``, its ``media_fn`` injection point, ``MediaKind``) live with
the rest of the media contract in ``veomni/contract/media.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from veomni.contract.plan import ParallelPlan, module_path_matches


@runtime_checkable
class TrainableModel(Protocol):
    """What the engine needs of every model a spec builds."""

    def parallel_plan(self) -> ParallelPlan: ...

    def init_weights(self) -> None:
        """Fill every parameter and buffer from the global torch RNG (seeded by the engine)."""
        ...


@runtime_checkable
class ConfiguredModule(Protocol):
    """A module built from one config dataclass, kept as ``config`` (the zoo's LLM, ViT, audio
    encoder and omni model). A pretrained folder loads into it only if the config its HF adapter
    reads from the folder equals this one (``HFAdapter.free_fields`` aside)."""

    config: Any


class CostModel(Protocol):
    """A family's cost model. ``units`` are the task's units of work (tokens, latent patches,
    nodes): what one row element of a batch is."""

    def batch_flops(self, model: nn.Module, batch: Mapping[str, Any]) -> float:
        """Forward + backward model FLOPs of one whole micro-batch (MFU numerator). Under sequence
        parallelism ``batch`` is this rank's slice of a row whose global layout it still carries;
        the engine divides by the sequence-parallel size."""
        ...

    def sample_flops(self, model: nn.Module, units: int) -> float:
        """Forward + backward FLOPs of one sample of ``units`` units (``--dry-run``)."""
        ...

    def activation_bytes_per_unit(self, model: nn.Module, bytes_per_elem: int, checkpointing: str) -> float:
        """Activation memory kept for backward per unit of a micro-batch (``--dry-run``)."""
        ...

    def activated_params(self, model: nn.Module) -> int:
        """Parameters one unit uses (MoE: only its routed experts)."""
        ...

    def report_lines(self, model: nn.Module, units: int) -> list[str]:
        """Extra ``--dry-run`` lines the family adds about itself (may be empty)."""
        ...


class SampleWriter(Protocol):
    """Generates and writes validation samples (a family's ``ModelSpec.sample_writer`` builds one)."""

    def __call__(self, model: nn.Module, step: int, out_dir: Path, write: bool) -> dict[str, Path]:
        """Generate with ``model`` (the whole model, every rank calling with the same inputs, so
        sharded weights' collectives match); only where ``write`` is true, write files under
        ``out_dir``. Returns name -> image file for loggers (wandb, TensorBoard); {} where not
        writing."""
        ...


class MoEHooks:
    """Base of models with mixture-of-experts layers. The model records what its latest forward
    saw; the engine does the communication (``veomni/train/moe_stats.py``)."""

    def moe_layers(self) -> list[nn.Module]:
        """The MoE layers, in model order (empty for a dense configuration)."""
        raise NotImplementedError

    def moe_aux_loss(self) -> torch.Tensor | None:
        """The latest forward's auxiliary losses (this rank's share), or None."""
        raise NotImplementedError

    def moe_load(self) -> torch.Tensor:
        """The latest forward's per-layer, per-expert token counts [layers, experts]."""
        raise NotImplementedError

    def update_router_bias(self, load: torch.Tensor) -> torch.Tensor:
        """Apply the auxiliary-loss-free bias update from the step's global load; return it."""
        raise NotImplementedError


def has_moe(model: nn.Module) -> bool:
    """True for a model with at least one MoE layer (a typed check, not attribute discovery)."""
    return isinstance(model, MoEHooks) and bool(model.moe_layers())


@dataclass(frozen=True)
class ParamRule:
    """Options for parameters whose name matches ``pattern`` (plan glob syntax) or ``predicate``."""

    options: dict[str, Any]
    pattern: str | None = None
    predicate: Callable[[str, nn.Parameter], bool] | None = field(default=None, compare=False)
    name: str = ""

    def matches(self, name: str, param: nn.Parameter) -> bool:
        if self.pattern is not None and module_path_matches(name, self.pattern):
            return True
        return self.predicate is not None and self.predicate(name, param)
