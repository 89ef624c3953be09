"""The rollout engines a recipe picks by name: ``rl.rollout_engine`` (docs/post_training.md).

An engine is built once per rank when the GRPO feed is built, from an ``EngineRequest`` (the run's
config, the parallelised policy, the device, the ranks that must run forward passes in lock step,
the tokenizer), and serves the ``RolloutEngine`` contract (``rollout.py``). Engines register by name
like objectives and dataset kinds, with the launcher's checks of the run for them (a missing
package, no device), which run before any worker starts, in a dry run as in a real launch.
``builtin`` (the trained model generating in the training processes) is registered here; ``vllm``
in ``vllm_engine.py``; a plug-in package listed in ``model.plugins`` may call
``register_rollout_engine``.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from veomni.config.schema import RunConfig
from veomni.contract.media import MediaLayout
from veomni.objectives.rollout import PolicyEngine, RolloutEngine


@dataclass(frozen=True)
class EngineRequest:
    """What a rollout engine is built from (once per rank)."""

    cfg: RunConfig
    policy: nn.Module
    """The trained model, parallelised by the recipe (the whole model on each rank)."""
    device: torch.device
    lockstep_group: dist.ProcessGroup | None
    """The ranks that must run the same number of forward passes (FSDP gathers); None: one process."""
    tokenizer: Any
    layout: MediaLayout | None = None
    """The model's media layout when the prompts carry images or videos (None: token prompts)."""


@dataclass(frozen=True)
class EngineEntry:
    build: Callable[[EngineRequest], RolloutEngine]
    checks: Callable[[RunConfig], list[str]] | None = None
    """The launcher's checks of the run for this engine (problems, each naming its fix; empty: none)."""


_ENGINES: dict[str, EngineEntry] = {}


def register_rollout_engine(name: str, build: Callable[[EngineRequest], RolloutEngine],
                            checks: Callable[[RunConfig], list[str]] | None = None) -> None:
    """Make ``rl.rollout_engine: <name>`` build its engine with ``build``."""
    entry = EngineEntry(build, checks)
    if _ENGINES.get(name, entry) != entry:
        raise ValueError(f"rollout engine {name!r} is already registered")
    _ENGINES[name] = entry


def rollout_engine_problems(cfg: RunConfig) -> list[str]:
    """The launcher's checks of ``rl.rollout_engine`` (after the plug-ins are imported)."""
    name = cfg.rl.rollout_engine
    if name not in _ENGINES:
        near = difflib.get_close_matches(name, _ENGINES, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        return [f"rl.rollout_engine: unknown engine {name!r}{hint} (registered: {sorted(_ENGINES)}; a plug-in "
                "package in model.plugins may register more)"]
    checks = _ENGINES[name].checks
    return checks(cfg) if checks is not None else []


def build_rollout_engine(request: EngineRequest) -> RolloutEngine:
    return _ENGINES[request.cfg.rl.rollout_engine].build(request)


def _builtin(request: EngineRequest) -> RolloutEngine:
    return PolicyEngine(request.policy, request.device, request.lockstep_group, request.layout)


register_rollout_engine("builtin", _builtin)
