"""The declaration a model makes about its own structure.

Models return a ``ParallelPlan`` from ``parallel_plan()``; the engine reads it and applies
parallelism from outside. This module must stay free of ``torch.distributed`` because models
import it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

from torch import nn


@dataclass(frozen=True)
class ParallelPlan:
    """Module paths by role, as globs over ``named_modules()`` names.

    Glob syntax: ``*`` matches one path segment (never a dot), ``**`` any number of segments,
    so ``layers.*`` matches ``layers.0`` but not ``layers.0.attn``.

    blocks:    repeated blocks; the unit of FSDP sharding, activation checkpointing, compile
               and pipeline cutting.
    experts:   grouped-expert modules whose weights shard on the leading expert dim.
    attention: attention modules exposing an ``attn_fn`` injection point; their inputs carry
               a sequence dim that sequence and context parallelism may split. Each declares
               ``num_heads``, ``num_kv_heads`` and ``causal`` (a decoder's mask, or full
               attention within each sample).
    stages:    ordered top-level pieces (embed, blocks container, head) for pipelines.
    message_passing: message-passing modules exposing an ``aggregate`` injection point
               (``veomni.ops.graph.NeighbourAggregation``); graph parallelism and layer pipelines
               replace it with one that exchanges halo rows and keeps historical embeddings.
    encoders:  sub-models of an omni model, each with its own plan.
    """

    blocks: tuple[str, ...] = ()
    experts: tuple[str, ...] = ()
    attention: tuple[str, ...] = ()
    stages: tuple[str, ...] = ()
    message_passing: tuple[str, ...] = ()
    encoders: dict[str, ParallelPlan] = field(default_factory=dict)


@functools.lru_cache(maxsize=256)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    parts = re.split(r"(\*\*|\*)", pattern)
    body = "".join(".*" if p == "**" else "[^.]*" if p == "*" else re.escape(p) for p in parts)
    return re.compile(f"^{body}$")


def module_path_matches(name: str, pattern: str) -> bool:
    """True when a dotted module path matches a plan glob (see ``ParallelPlan``)."""
    return _glob_regex(pattern).match(name) is not None


def match_modules(root: nn.Module, patterns: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """Return ``(name, module)`` for every submodule whose path matches one of ``patterns``.

    Order follows ``named_modules()`` (definition order), which is what FSDP wrapping and
    pipeline cutting need.
    """
    return [
        (name, module)
        for name, module in root.named_modules()
        if name and any(module_path_matches(name, p) for p in patterns)
    ]


def prefixed(plan: ParallelPlan, prefix: str) -> ParallelPlan:
    """``plan`` of a submodule at path ``prefix``, as seen from its parent (globs prefixed)."""
    def add(patterns: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(f"{prefix}.{p}" for p in patterns)

    return ParallelPlan(blocks=add(plan.blocks), experts=add(plan.experts), attention=add(plan.attention),
                        stages=add(plan.stages), message_passing=add(plan.message_passing),
                        encoders={f"{prefix}.{k}": v for k, v in plan.encoders.items()})


def flatten_plan(plan: ParallelPlan) -> ParallelPlan:
    """One plan over the whole model: each encoder sub-plan (keyed by the encoder's module path)
    joins the top-level roles with its globs prefixed, so FSDP, activation checkpointing and
    compile treat encoder blocks like the LLM's. ``stages`` stay the top-level model's."""
    blocks, experts, attention = list(plan.blocks), list(plan.experts), list(plan.attention)
    message_passing = list(plan.message_passing)
    for path, sub in plan.encoders.items():
        flat = prefixed(flatten_plan(sub), path)
        blocks += flat.blocks
        experts += flat.experts
        attention += flat.attention
        message_passing += flat.message_passing
    return ParallelPlan(blocks=tuple(blocks), experts=tuple(experts), attention=tuple(attention),
                        stages=plan.stages, message_passing=tuple(message_passing))
