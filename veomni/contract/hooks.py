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
- ``AttentionModule`` (its ``AttentionSpec``), ``ExpertGroup`` and ``MoELayer``: what the plan's
  ``attention`` and ``experts`` modules declare to the parallel recipes, so the engine reads no
  weight shapes and probes no attributes; ``attention_modules`` / ``expert_modules`` match the
  plan's modules and name the model, the module and the missing hook when one lacks it.
  ``AttentionWrapper``: the base of the ``attn_fn`` wrappers the recipes install.

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

from veomni.contract.plan import ParallelPlan, match_modules, module_path_matches


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


@dataclass(frozen=True)
class AttentionSpec:
    """The shape an attention module declares to the recipes around its ``attn_fn``."""

    num_heads: int
    """Query heads (Ulysses gives each sequence-parallel rank ``num_heads / sp`` of them)."""
    num_kv_heads: int
    """K/V heads (GQA: a divisor of ``num_heads``; Ulysses repeats them as needed)."""
    head_dim: int
    """Elements per head (the planner's and Mesh-Attention's cost models)."""
    causal: bool
    """True for a decoder's mask, False for full attention within each sample: context
    parallelism skips and masks blocks by it."""


@runtime_checkable
class AttentionModule(Protocol):
    """A module the plan lists under ``attention``. Its forward calls ``self.attn_fn(q, k, v, seq)``
    on [tokens, heads, head_dim] tensors (single-device default: a ``veomni.ops.attention`` core),
    the injection point sequence and context parallelism replace; ``attention_spec()`` says what
    they need to know about it."""

    attn_fn: Callable[..., torch.Tensor]

    def attention_spec(self) -> AttentionSpec: ...


class AttentionWrapper:
    """Base of the ``attn_fn`` values the engine installs around a module's own (Ulysses, context
    parallelism, an encoder's row shares): ``inner`` is the function each wraps, so the chain
    unwinds to the model's core (``veomni.parallel.sequence.full_sequence_attention``)."""

    inner: Callable[..., torch.Tensor]


@runtime_checkable
class ExpertGroup(Protocol):
    """A module the plan lists under ``experts``: grouped expert weights, every parameter leading
    with the expert dim, which expert parallelism shards."""

    local_weight: Callable[[torch.Tensor], torch.Tensor]
    """Injection point applied to each weight inside ``forward`` (default: identity); expert
    parallelism sets it to take this rank's slice of the weight FSDP gathered."""

    def expert_count(self) -> int:
        """Experts in the group, whole (the leading dim of its parameters before any sharding)."""
        ...


@runtime_checkable
class AdaptableExperts(ExpertGroup, Protocol):
    """An ``ExpertGroup`` that takes LoRA: one adapter per expert (``veomni/adapters/lora.py``)."""

    expert_delta: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor] | None
    """Injection point for a low-rank update: called as ``expert_delta(weight name, rows sorted by
    expert, rows per local expert)`` for each grouped projection, its result added to the
    projection's output; None (the default) adds nothing."""


@runtime_checkable
class MoELayer(Protocol):
    """The parent module of an ``ExpertGroup``: it hands tokens to its experts through
    ``dispatcher(x, expert_idx, weights, experts)`` and reduces per-expert token counts through
    ``reduce_load(counts)``, injection points with single-device defaults (``docs/moe.md``)."""

    dispatcher: Callable[..., torch.Tensor]
    reduce_load: Callable[[torch.Tensor], torch.Tensor]


def declared_modules(model: nn.Module, patterns: tuple[str, ...], hook: type, role: str,
                     needs: str) -> list[tuple[str, Any]]:
    """``match_modules(model, patterns)`` (the plan's ``role`` modules), each checked to implement
    the runtime-checkable ``hook``; a ``TypeError`` names the model, the module and what it lacks."""
    found = match_modules(model, patterns)
    for path, module in found:
        if not isinstance(module, hook):
            raise TypeError(f"{type(model).__name__}: {path} ({type(module).__name__}) is listed in "
                            f"parallel_plan().{role} but does not implement {hook.__module__}.{hook.__name__}: "
                            f"{needs} (see docs/adding_a_model.md)")
    return found


def attention_modules(model: nn.Module, patterns: tuple[str, ...]) -> list[tuple[str, AttentionModule]]:
    """The plan's attention modules of ``model``, each an ``AttentionModule`` (``TypeError`` if not)."""
    return declared_modules(model, patterns, AttentionModule, "attention",
                            "an `attn_fn` injection point and `attention_spec()` returning its AttentionSpec "
                            "(num_heads, num_kv_heads, head_dim, causal)")


def expert_modules(model: nn.Module, patterns: tuple[str, ...]) -> list[tuple[str, ExpertGroup]]:
    """The plan's grouped-expert modules of ``model``, each an ``ExpertGroup`` whose parent is a
    ``MoELayer`` (``TypeError`` naming the model and the module if not)."""
    found = declared_modules(model, patterns, ExpertGroup, "experts",
                             "a `local_weight` injection point and `expert_count()`")
    for path, _ in found:
        parent_path = path.rpartition(".")[0]
        layer = model.get_submodule(parent_path) if parent_path else model
        if not isinstance(layer, MoELayer):
            raise TypeError(f"{type(model).__name__}: {parent_path or 'the model'} ({type(layer).__name__}) holds the "
                            f"grouped experts {path} but does not implement {MoELayer.__module__}.MoELayer: "
                            "`dispatcher` and `reduce_load` injection points (see docs/moe.md)")
    return found
