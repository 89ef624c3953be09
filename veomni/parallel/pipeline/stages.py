"""Pipeline parallelism: cut a model into stages from its plan and run a schedule over them.

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
travel between stages; the last stage's loss reads the contract's ``target``.

Loss. The last stage computes each micro-batch's summed loss times ``scale`` (the caller's
``loss_size / global_units``, the same normalisation as without pipelining) and the schedule
runs with ``scale_grads=False``, so gradients equal the one-process gradients of the step.
MoE models also tie each stage's auxiliary losses to its output and sum its expert loads,
through the stage-output hook ``step`` accepts (``veomni/train/moe_stats.PipelineMoEStats``).

Modalities. A graph model's schedules and a media model's encoders need rules and stage pieces
of their own; they come in through ``StageHooks`` (``stage_hooks.py``), which the wiring layer fills from the graph
and media wings (``veomni/parallel/apply.py``, ``PIPELINE_HOOKS``), so this package imports
neither.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

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
from veomni.parallel.pipeline.p2p import recv_tensor, send_tensor
from veomni.parallel.pipeline.stage_hooks import StageEncoders, StageHooks
from veomni.parallel.pipeline.tied import TiedCopies, check_tied, tied_across_pieces, tied_stage
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


# Added to an error in a pipeline's first step: its likeliest cause, which no launch check sees (no batch).
FIRST_STEP_NOTE = ("parallel.pp: this failed in the pipeline's first step. Every stage runs the model's forward with "
                   "the pieces it does not own replaced by nn.Identity: work in forward between the stage pieces "
                   "(pooling before the head, say) runs on every stage and changes what the next stage receives; "
                   "move it into a piece (docs/adding_a_model.md, 'Pipeline parallelism').")

StageOutputHook = Callable[[nn.Module, torch.Tensor], torch.Tensor]
"""``hook(stage_module, output) -> output`` after each training forward of a stage."""


def _differentiable_output(module: nn.Module, args: Any, output: Any) -> Any:
    """A training forward's hidden state that does not require grad (nothing before it trains: a
    LoRA run's frozen embedding and first blocks) made a leaf that does, so the next stage's input
    requires grad: the zero-bubble schedules' split backward finds a stage's weight gradients on
    the paths from its inputs, and computes none for a later stage whose inputs need none."""
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.is_floating_point() \
            and not output.requires_grad:
        return output.detach().requires_grad_()
    return None


class _Stage(PipelineStage):
    """A ``PipelineStage`` whose training forwards pass their output through ``on_output``. Hooked
    here, not with a module forward hook: the schedule also runs each stage once on placeholder
    inputs to learn the shapes it sends, and that forward must not count."""

    on_output: StageOutputHook | None = None

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        output = super().forward_maybe_with_nosync(*args, **kwargs)
        return output if self.on_output is None else self.on_output(self.submod, output)


class Pipeline:
    """This rank's stage modules and the schedule that drives them.

    ``task.output_loss(output, target)`` gives a micro-batch's summed loss; ``step`` multiplies it by
    the step's ``scale`` before backward and returns the unscaled sum of this rank's last-stage
    micro-batches (0 on other ranks).
    """

    def __init__(self, parts: list[nn.Module], stage_indices: list[int], cfg: ParallelConfig, microbatches: int,
                 pp_group: dist.ProcessGroup, device: torch.device,
                 task: Task, encoders: StageEncoders | None = None,
                 tied: list[dict[int, str]] | None = None) -> None:
        self.parts, self.stage_indices = parts, stage_indices
        self.encoders = encoders
        self.microbatches = microbatches
        self.task, self.contract = task, task.contract
        self._scale = 1.0
        self._row_tokens: int | None = None
        self._stepped = False
        n_stages = cfg.pp * virtual_stages(cfg)
        self.n_stages, self.pp_group, self.device = n_stages, pp_group, device
        self.pp_rank = dist.get_rank(pp_group)
        self._owner = {i: r for r in range(cfg.pp)
                       for i in stage_ids(r, cfg.pp, virtual_stages(cfg), cfg.pp_schedule)}
        self._by_index = dict(zip(stage_indices, parts))
        self.stages = [_Stage(part, index, n_stages, device, group=pp_group)
                       for part, index in zip(parts, stage_indices)]
        for stage in self.stages:
            if not stage.is_last:
                stage.submod.register_forward_hook(_differentiable_output)
        self.has_last_stage = any(s.is_last for s in self.stages)
        self.has_first_stage = 0 in stage_indices
        self.tied = TiedCopies(tied, parts, stage_indices, self._owner, pp_group) if tied else None
        schedule_cls = get_schedule_class(cfg.pp_schedule)
        single = issubclass(schedule_cls, PipelineScheduleSingle)
        self.schedule = schedule_cls(self.stages[0] if single else self.stages, n_microbatches=microbatches,
                                     loss_fn=self._scaled_loss, scale_grads=False)

    @property
    def uncounted(self) -> list[nn.Parameter]:
        """Parameters that grad-norm clipping must leave out of the norm: the tied copies past the
        first (``tied.py``)."""
        return self.tied.uncounted if self.tied is not None else []

    @property
    def modules(self) -> list[nn.Module]:
        """Every module this rank holds and steps: its stages, then the encoders when they run
        outside the stages (``hooks.media``)."""
        return self.parts + ([self.encoders.part] if self.encoders is not None else [])

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.task.output_loss(output, target) * self._scale

    def step(self, rows: list[dict[str, Any]], scale: float, on_output: StageOutputHook | None = None) -> float:
        """Forward and backward over ``rows`` (one per micro-batch, same token count).
        ``on_output`` sees (and may replace) every stage output of this step's forwards, e.g. to
        join a stage's auxiliary losses to backward (``moe_stats.PipelineMoEStats``)."""
        if len(rows) != self.microbatches:
            raise ValueError(f"the pipeline runs {self.microbatches} micro-batches per step, got {len(rows)}")
        sizes = {self.contract.row_length(row) for row in rows}
        self._row_tokens = self._row_tokens or min(sizes)
        if sizes != {self._row_tokens}:
            raise ValueError(f"pipeline micro-batches must all hold {self._row_tokens} tokens (the stages' "
                             f"buffers are sized once), got {sorted(sizes)}; pad them with pad_row")
        self._scale = scale
        args = [(row[self.contract.stage_input],) for row in rows]
        kwargs = [self._stage_kwargs(row, media) for row, media in zip(rows, self._media(rows))]
        losses: list[torch.Tensor] = []
        # What ``schedule.step`` does, minus its splitting of one batch tensor into equal chunks:
        # packed rows come already cut, with per-row boundaries.
        for stage in self.stages:
            stage.has_backward = True
            stage.clear_runtime_states()
            stage.on_output = on_output
        try:
            self.schedule._step_microbatches(args, kwargs, [row[self.contract.target] for row in rows], losses,
                                             return_outputs=False)
        except Exception as exc:
            if not self._stepped:
                exc.add_note(FIRST_STEP_NOTE)
            raise
        finally:
            for stage in self.stages:
                stage.on_output = None
        if self.encoders is not None:  # the cool-down: the features' gradients are all in
            self.encoders.backward()
        if self.tied is not None:  # every copy of a tied parameter gets the one-process gradient
            self.tied.sync()
        self._stepped = True
        return sum(float(loss.detach()) for loss in losses) / scale if losses else 0.0

    @torch.no_grad()
    def evaluate(self, rows: list[dict[str, Any]]) -> tuple[float, list[dict[str, tuple[torch.Tensor, int]]]]:
        """Forward only; the summed loss of the rows and each row's ``task.output_metrics`` on the last
        stage (0 and none elsewhere).

        Not through the schedule: this torch's runtime schedules cannot run forward-only in the V
        layout (the local stage-to-stage hand-off expects a backward). Rows walk the stages in
        order instead, hidden states sent point-to-point with a small shape header.
        """
        loss_sum, metrics = 0.0, []
        for row, media in zip(rows, self._media(rows)):
            kwargs = self._stage_kwargs(row, media)
            x = row[self.contract.stage_input]
            for index in range(self.n_stages):
                owner, previous = self._owner[index], self._owner.get(index - 1)
                if owner != self.pp_rank:
                    if previous == self.pp_rank:
                        send_tensor(x, owner, self.pp_group)
                    continue
                if previous is not None and previous != self.pp_rank:
                    x = recv_tensor(previous, self.pp_group, self.device)
                x = self._by_index[index](x, **kwargs)
            if self.has_last_stage:
                loss_sum += float(self.task.output_loss(x, row[self.contract.target]))
                metrics.append(self.task.output_metrics(x, row[self.contract.target]))
        return loss_sum, metrics

    def _media(self, rows: list[dict[str, Any]]) -> list[Any]:
        """Per row, what the first stage gets as its media input: the encoded features when the
        encoders run outside the stages (encoded now, on every rank), else the row's own media
        (the first stage runs its encoders inline); None for models without media."""
        if self.encoders is not None:
            return self.encoders.encode(rows)
        field = self.contract.media
        return [row.get(field) if field else None for row in rows]

    def _stage_kwargs(self, row: dict[str, Any], media: Any = None) -> dict[str, Any]:
        """What every stage gets besides the hidden state: the contract's stage keyword inputs
        (``max_seqlen`` as an int), the count of real rows before the row's padding (MoE
        layers route only those) and, on the first stage's rank, the row's ``media``. (Every
        stage of a rank gets the same keywords: models with media run one stage per rank.)"""
        kwargs = {k: int(row[k]) if k == "max_seqlen" else row[k] for k in self.contract.stage_kwargs}
        if self.contract.media and self.has_first_stage:
            kwargs[self.contract.media] = media
        return {**kwargs, "valid_tokens": row.get("valid_tokens")}


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
    colocate = cfg.encoder_colocate
    makers = [functools.partial(_cut_and_parallelize, stage=i, counts=counts, parallelize=parallelize,
                                hollow=media.hollow if media is not None and (colocate or i > 0) else None)
              for i in indices]
    if media is not None and colocate:
        if meshes is None:
            raise ValueError("a pipelined model with media encoders needs the layout's meshes (ParallelMeshes)")
        makers.append(media.part_maker(cfg, meshes, device))
    return build_sharded_parts(build, initialise, makers, device, strict=False), indices


def _cut_and_parallelize(model: nn.Module, stage: int, counts: list[int],
                         parallelize: Callable[[nn.Module], nn.Module],
                         hollow: Callable[[nn.Module], nn.Module] | None = None) -> nn.Module:
    model = cut_stage(model, stage, counts)
    return parallelize(hollow(model) if hollow is not None else model)
