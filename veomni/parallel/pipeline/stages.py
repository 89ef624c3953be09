"""Pipeline parallelism: cut a model into stages from its plan and build the ``Pipeline`` that runs them.

Cutting. The plan's ``stages`` list the model's top-level pieces in order (embedding, the blocks
container, final norm, head); ``blocks`` name the blocks inside the container. A stage module is
the whole model with the pieces it does not own replaced by ``nn.Identity`` and its container
holding only its own blocks, each under its original index. So stage 1 of a 4-layer model owns
``layers.2.attn.q_proj.weight``, named exactly as in one process: DCP checkpoints move between
pipeline sizes by resharding alone, and the model's own ``forward`` runs unchanged (on a later
stage ``embed_tokens`` passes the incoming hidden state through).

Micro-batches. A pipeline micro-batch is one packed row padded to a fixed length
(``rows.py``); the first stage takes the contract's ``stage_input``, its
``stage_kwargs`` and ``valid_tokens`` go to every stage as keyword inputs, and only hidden states
travel between stages; the last stage's loss reads the contract's ``target`` (``schedule.py``
runs the schedule and computes the loss).

Modalities. A graph model's schedules and a media model's encoders need rules and stage pieces
of their own; they come in through ``StageHooks`` (``stage_hooks.py``), which the wiring layer fills from the graph
and media wings (``veomni/parallel/apply.py``, ``PIPELINE_HOOKS``), so this package imports
neither.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from veomni.config.schema import ParallelConfig
from veomni.contract.plan import ParallelPlan, match_modules
from veomni.parallel.materialize import build_sharded_parts
from veomni.parallel.mesh import ParallelMeshes
from veomni.parallel.pipeline.layout import (
    PipelineConfigError,
    TooFewBlocksError,
    balanced_split,
    check_pipeline,
    microbatch_count,
    stage_ids,
    virtual_stages,
)
from veomni.parallel.pipeline.schedule import Pipeline
from veomni.parallel.pipeline.stage_hooks import StageHooks
from veomni.parallel.pipeline.tied import check_tied, tied_across_pieces, tied_stage
from veomni.tasks.base import Task

logger = logging.getLogger(__name__)


class StageBlocks(nn.Module):
    """The blocks one stage owns, under their original indices (``"5"`` for ``layers.5``); iterating
    yields them in order, as a model's ``for layer in self.layers`` expects of its ``nn.ModuleList``."""

    def __init__(self, blocks: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, block in blocks.items():
            self.add_module(name, block)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)


def _container(model: nn.Module, plan: ParallelPlan) -> tuple[str, list[tuple[str, nn.Module]]]:
    """The stage piece holding every block, and the blocks (names relative to the model)."""
    blocks = match_modules(model, plan.blocks)
    for piece in plan.stages:
        inside = [(name, block) for name, block in blocks if name.startswith(piece + ".")]
        if inside:
            if len(inside) != len(blocks):
                outside = [name for name, _ in blocks if not name.startswith(piece + ".")]
                raise PipelineConfigError(f"{type(model).__name__}: blocks {outside} lie outside the pipelined "
                                          f"container '{piece}' (e.g. a multi-token head); pipelining supports "
                                          "models whose blocks all sit in one container: set parallel.pp=1")
            return piece, inside
    raise PipelineConfigError(f"{type(model).__name__}.parallel_plan() declares no stage piece holding its blocks "
                              f"(stages {plan.stages}, blocks {plan.blocks}); it cannot be pipelined")


def stage_block_counts(model: nn.Module, cfg: ParallelConfig) -> list[int]:
    """Blocks per global stage: ``pp_layer_split``, else balanced by parameter count (graph
    models: by block count, since a message-passing layer's cost is its aggregation)."""
    plan = model.parallel_plan()
    piece, blocks = _container(model, plan)
    n_stages = cfg.pp * virtual_stages(cfg)
    if cfg.pp_layer_split:
        return list(cfg.pp_layer_split)
    if n_stages > len(blocks):
        raise TooFewBlocksError(f"{n_stages} pipeline stages but the model has only {len(blocks)} blocks")
    if plan.message_passing:  # a graph layer's work is its aggregation over every edge, not its weights
        return balanced_split([1] * len(blocks), n_stages)
    index = plan.stages.index(piece)
    count = lambda names: sum(p.numel() for n in names for p in model.get_submodule(n).parameters())  # noqa: E731
    return balanced_split([sum(p.numel() for p in b.parameters()) for _, b in blocks], n_stages,
                          first_extra=count(plan.stages[:index]), last_extra=count(plan.stages[index + 1:]))


def cut_stage(model: nn.Module, stage: int, counts: list[int]) -> nn.Module:
    """Turn ``model`` (in place) into global stage ``stage`` of ``len(counts)``; returns it."""
    plan = model.parallel_plan()
    piece, blocks = _container(model, plan)
    start = sum(counts[:stage])
    prefix = len(piece) + 1
    kept = {name[prefix:]: block for name, block in blocks[start:start + counts[stage]]}
    index = plan.stages.index(piece)
    owned = {piece}
    if stage == 0:
        owned.update(plan.stages[:index])
    if stage == len(counts) - 1:
        owned.update(plan.stages[index + 1:])
    for name in plan.stages:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if name == piece:
            setattr(parent, attr, StageBlocks(kept))
        elif name not in owned:
            setattr(parent, attr, nn.Identity())
    return model


def check_pipeline_model(model: nn.Module, cfg: ParallelConfig, grad_accum: int, hooks: StageHooks) -> None:
    """Everything about a pipeline that can be checked on the (meta) model before any worker
    starts: the wings' rules (``hooks.checks``), the settings against its block count, and what
    stage cutting cannot handle."""
    if cfg.pp == 1:
        return
    plan = model.parallel_plan()
    piece, blocks = _container(model, plan)
    for check in hooks.checks:
        check(model, cfg, grad_accum)
    check_pipeline(cfg, grad_accum, num_blocks=len(blocks), own_schedule=bool(plan.message_passing))
    check_tied(model, plan, piece)


def check_pipeline_task(task: Task, cfg: ParallelConfig) -> None:
    """Pipelines feed the contract's ``stage_input`` to the first stage and compute the loss from
    the last stage's output alone (``task.output_loss``)."""
    if cfg.pp > 1 and task.contract.stage_input is None:
        raise PipelineConfigError(f"parallel.pp={cfg.pp}: the task {type(task).__name__} does not run on a pipeline "
                                  "(its batch contract names no stage input); set parallel.pp=1")


def build_pipeline(build: Callable[[], nn.Module], initialise: Callable[[nn.Module], None],
                   parallelize: Callable[[nn.Module], nn.Module], cfg: ParallelConfig, grad_accum: int,
                   pp_mesh: DeviceMesh, device: torch.device, task: Task,
                   meshes: ParallelMeshes | None = None, probe: nn.Module | None = None, *,
                   hooks: StageHooks) -> Pipeline:
    """This rank's stages (``build_stage_parts``) and the ``torch.distributed.pipelining``
    schedule that drives them. A model with media encoders (``parallel.encoder_colocate``) also
    gets them on every rank, their work run around the schedule by ``hooks.media``
    (the media wing's ``pipeline_encoders.py``). ``probe``: a meta build of the model, when
    the caller has one."""
    check_pipeline_task(task, cfg)
    if probe is None:
        with torch.device("meta"):
            probe = build()
    parts, indices = build_stage_parts(build, initialise, parallelize, cfg, grad_accum, pp_mesh, device, meshes,
                                       probe, hooks=hooks)
    encoders = None
    if len(parts) > len(indices):  # only hooks.media adds a part (build_stage_parts)
        part = parts.pop()
        encoders = hooks.media.around_schedule(part, parts, 0 in indices, task, cfg, meshes, device)
    return Pipeline(parts, indices, cfg, microbatch_count(cfg, grad_accum), pp_mesh.get_group(), device, task,
                    encoders, tied_copies(probe, cfg))


def tied_copies(model: nn.Module, cfg: ParallelConfig) -> list[dict[int, str]]:
    """Per group of parameter names tied across the stage pieces of ``model`` (a meta build),
    ``{global stage: name}`` of the stages that hold a copy (``tied.py``); empty for
    untied models."""
    plan = model.parallel_plan()
    piece, _ = _container(model, plan)
    n_stages = cfg.pp * virtual_stages(cfg)
    return [{tied_stage(name, plan, piece, n_stages): name for name in group}
            for group in tied_across_pieces(model, plan)]


def build_stage_parts(build: Callable[[], nn.Module], initialise: Callable[[nn.Module], None],
                      parallelize: Callable[[nn.Module], nn.Module], cfg: ParallelConfig, grad_accum: int,
                      pp_mesh: DeviceMesh, device: torch.device, meshes: ParallelMeshes | None = None,
                      probe: nn.Module | None = None, *, hooks: StageHooks) -> tuple[list[nn.Module], list[int]]:
    """This rank's stage modules and their global stage indices, cut from the model ``build()``
    makes, parallelised by ``parallelize`` (FSDP / EP within the stage's ranks) and filled with
    rank 0's initial weights exactly as in one process (see ``materialize.py``). A model with
    media encoders (``hooks.media``) colocated (``parallel.encoder_colocate``) gets one more part
    after the stages: the encoders, sharded over ``meshes.encoder_fsdp``; its stages hold none.
    Run inline, the encoders stay in the first stage only. ``probe``: a meta build of the model,
    when the caller has one."""
    if probe is None:
        with torch.device("meta"):
            probe = build()
    check_pipeline_model(probe, cfg, grad_accum, hooks)
    counts = stage_block_counts(probe, cfg)
    indices = stage_ids(pp_mesh.get_local_rank(), cfg.pp, virtual_stages(cfg), cfg.pp_schedule)
    logger.info("pipeline %s: %d stages with %s blocks; this rank runs stages %s", cfg.pp_schedule, len(counts),
                counts, indices)
    media = hooks.media if hooks.media is not None and hooks.media.applies(probe) else None
    apart = hooks.encoders_apart(probe, cfg)
    makers = [functools.partial(_cut_and_parallelize, stage=i, counts=counts, parallelize=parallelize,
                                hollow=media.hollow if media is not None and (apart or i > 0) else None)
              for i in indices]
    if apart:
        if meshes is None:
            raise ValueError("a pipelined model with media encoders needs the layout's meshes (ParallelMeshes)")
        makers.append(media.part_maker(cfg, meshes, device))
    return build_sharded_parts(build, initialise, makers, device, strict=False), indices


def _cut_and_parallelize(model: nn.Module, stage: int, counts: list[int],
                         parallelize: Callable[[nn.Module], nn.Module],
                         hollow: Callable[[nn.Module], nn.Module] | None = None) -> nn.Module:
    model = cut_stage(model, stage, counts)
    return parallelize(hollow(model) if hollow is not None else model)
