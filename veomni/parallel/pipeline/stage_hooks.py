"""What modality wings add to generic pipelining, declared here so that the pipeline package
imports none of them.

A graph model pipelines its chunks with schedules of its own, and a media model runs its
encoders outside the stages (Optimus); each wing has rules and stage pieces of its own. The
builders and checks of ``stages.py`` take a ``StageHooks`` and call the wings only through it;
the wiring layer fills it in from the graph and media wings (``veomni/parallel/apply.py``,
``PIPELINE_HOOKS``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from veomni.config.schema import ParallelConfig
from veomni.parallel.mesh import ParallelMeshes
from veomni.tasks.base import Task

ModelCheck = Callable[[nn.Module, ParallelConfig, int], None]
"""``check(model, cfg, grad_accum)``: raise ``PipelineConfigError`` when the pipeline settings do
not fit what a wing knows about the (meta) model; a model the wing does not concern passes."""


class StageEncoders(Protocol):
    """Encoders run outside the stages, around the schedule (a media wing's; one per pipeline)."""

    part: nn.Module
    """The module holding them: stepped by the optimizer with this rank's stages."""

    def encode(self, rows: list[dict[str, Any]]) -> list[Any]:
        """Per row, the first stage's media keyword input (every rank calls it with the same rows)."""
        ...

    def backward(self) -> None:
        """The encoders' backward once the schedule has left the features' gradients."""
        ...


class StageMedia(Protocol):
    """How a media wing cuts and feeds the stages of a model whose encoders pipelines treat apart."""

    def applies(self, model: nn.Module) -> bool:
        """Whether ``model`` (a meta build) has encoders this wing runs."""
        ...

    def hollow(self, model: nn.Module) -> nn.Module:
        """A cut stage without the encoders' work (their names kept, the features spliced in)."""
        ...

    def part_maker(self, cfg: ParallelConfig, meshes: ParallelMeshes,
                   device: torch.device) -> Callable[[nn.Module], nn.Module]:
        """Turns a whole model into the part holding only its encoders (one more part after the stages)."""
        ...

    def around_schedule(self, part: nn.Module, stages: list[nn.Module], first_stage: bool, task: Task,
                        cfg: ParallelConfig, meshes: ParallelMeshes, device: torch.device) -> StageEncoders:
        """What runs the encoder ``part`` before and after each step of this rank's ``stages``."""
        ...


@dataclass(frozen=True)
class StageHooks:
    """What modality wings add to pipelining (module doc). The builders and checks of
    ``stages.py`` require one, so no caller leaves the wings out by accident; ``StageHooks()``
    is right for a caller that knows its model has neither graph layers nor media encoders."""

    checks: tuple[ModelCheck, ...] = ()
    """Run in order before the generic rules, so that a schedule a wing refuses says so first."""
    media: StageMedia | None = None
    """The media wing; None: models are cut as they are, encoders included."""

    def encoders_apart(self, model: nn.Module, cfg: ParallelConfig) -> bool:
        """Whether a pipeline runs ``model``'s (a meta build) encoders as a part of their own after
        the stages: the media wing has encoders to run and ``parallel.encoder_colocate`` is set."""
        return cfg.encoder_colocate and self.media is not None and self.media.applies(model)
