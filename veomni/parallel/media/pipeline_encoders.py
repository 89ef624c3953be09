"""Media encoders under pipeline parallelism: colocated on every pipeline rank, run outside the
schedule (Optimus, see docs/pipeline.md "Models with media encoders").

Inline, the encoders would run inside the first stage: every micro-batch's encoder forward
delays the first stage's forward (and so every later stage's), and its backward the end of the
step, while the other stages sit idle in the warm-up and cool-down bubbles. Here instead:

- every rank holds the encoders (``encoder_part``: the model with its LLM pieces hollowed out,
  so parameter names stay those of one process), FSDP-sharded over all pipeline x data-parallel
  ranks (``ParallelMeshes.encoder_fsdp``: ``parallel.encoder_fsdp`` ranks per shard group, all
  of them by default): gradient reduction sums every stage's share, the optimizer updates each
  shard once, checkpoints hold the encoder once, and the clip norm counts it once;
- the stage modules keep the encoders' names but not their work (``hollow_encoders``): their
  ``media_fn`` splices features handed in with the micro-batch (``spliced_features``);
- before the schedule, ``PipelineEncoders.encode`` encodes the media of all the step's
  micro-batches at once, spread over the ranks (below), and hands the first stage each
  micro-batch's features as slices of one detached leaf per modality;
- after the schedule, that leaf holds the features' gradients; ``PipelineEncoders.backward``
  runs the encoders' backward with them on every rank, before the optimizer step.

Which rank encodes which item: every pipeline rank of a data-parallel group reads the same loader
rows, so all of them hold the step's media. The encoders route it with the one media router
(``colocate.RoutedMediaFn`` over ``route.route_media``, on ``ParallelMeshes.media``: every
pp x dp rank, in rank order): the pp ranks of a data-parallel group are the *peers* of its rows
(the first stage peer 0), they split the items by encoder cost among themselves with no input
moving, and every feature row goes to the first stage (``holders`` all zero) by the router's
differentiable all-to-all. With ``parallel.encoder_balance`` the items spread over all pp x dp
ranks by cost; with ``parallel.encoder_sp`` long items run sequence-parallel over blocks of
consecutive ranks. Every rank makes the same encoder calls (a rank with nothing to run runs the
dummy input), so the encoders' FSDP collectives match. The backward goes from the first stage's
feature gradients through the inverse all-to-all to the encoders of the ranks that ran each
item. Because the encoder mesh averages gradients over pp x dp ranks while the loss is
normalised for the dp ranks only, the feature gradients are scaled by pp before that backward.

The generic pipeline reaches all this only through ``PipelineMedia`` (its ``StageMedia`` hook,
``veomni/parallel/pipeline/stage_hooks.py``, whose ``check`` is one of its checks), which the wiring
layer hands it (``veomni/parallel/apply.py``, ``PIPELINE_HOOKS``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from veomni.config.schema import ParallelConfig
from veomni.contract.media import MediaHost
from veomni.contract.plan import ParallelPlan
from veomni.parallel.activation_checkpoint import apply_activation_checkpointing
from veomni.parallel.fsdp import apply_fsdp, mixed_precision_policy
from veomni.parallel.media.colocate import RoutedMediaFn, long_items
from veomni.parallel.media.encoder_sp import apply_encoder_sp
from veomni.parallel.mesh import ParallelMeshes
from veomni.parallel.pipeline.layout import SINGLE_STAGE_SCHEDULES, PipelineConfigError
from veomni.tasks.base import Task

logger = logging.getLogger(__name__)


def has_media(model: nn.Module) -> bool:
    return isinstance(model, MediaHost) and bool(model.parallel_plan().encoders)


def check_pipeline_media(model: nn.Module, cfg: ParallelConfig) -> None:
    """A model with encoders pipelines with one stage per rank (the features enter the one first
    stage; the interleaved and split-backward schedules are not supported) and without sequence
    or context parallelism (the features would have to be scattered over a row's slices)."""
    if cfg.pp == 1 or not has_media(model):
        return
    if cfg.pp_schedule not in SINGLE_STAGE_SCHEDULES:
        raise PipelineConfigError(f"parallel.pp_schedule={cfg.pp_schedule}: a model with media encoders pipelines "
                                  f"with one stage per rank ({' or '.join(SINGLE_STAGE_SCHEDULES)}); set one")
    split = [f"parallel.{k}={v}" for k, v in (("sp", cfg.sp), ("cp", cfg.cp)) if v > 1]
    if split:
        raise PipelineConfigError(f"parallel.pp={cfg.pp} with {', '.join(split)}: a model with media encoders is "
                                  "not pipelined with sequence or context parallelism yet; set them to 1")


def spliced_features(name: str, encoder: nn.Module, media: Mapping[str, Any] | None,
                     dummy_inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The ``MediaFn`` of hollowed stages: the features arrive ready in
    ``media["inputs"]["features"]``;
    a micro-batch (or a later stage) without items gets no rows."""
    if media is None:
        return next(iter(dummy_inputs.values())).new_zeros(0)
    return media["inputs"]["features"]


class HollowEncoder(nn.Identity):
    """An encoder's place in a stage module: no parameters, no work, an empty plan."""

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan()


def _replace(model: nn.Module, paths: list[str], stand_in: type[nn.Module] = nn.Identity) -> None:
    for path in paths:
        parent_name, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, stand_in())


def hollow_encoders(model: nn.Module) -> nn.Module:
    """A pipeline stage without encoder work: each encoder becomes a ``HollowEncoder`` (its name stays,
    its parameters live in the encoder part) and the stage splices given features."""
    _replace(model, list(model.parallel_plan().encoders), HollowEncoder)
    model.media_fn = spliced_features
    return model


def encoder_part(model: nn.Module, cfg: ParallelConfig, mesh: DeviceMesh, device_type: str) -> nn.Module:
    """The model reduced to its encoders (the LLM pieces hollowed out), each encoder ready for
    long items (``parallel.encoder_sp``), activation-checkpointed and FSDP-sharded over ``mesh``
    by its own plan."""
    plan: ParallelPlan = model.parallel_plan()
    _replace(model, list(plan.stages))
    if cfg.encoder_sp > 1:
        apply_encoder_sp(model)
    policy = mixed_precision_policy(cfg.mixed_precision, device_type)
    for path, encoder_plan in plan.encoders.items():
        encoder = model.get_submodule(path)
        apply_activation_checkpointing(encoder, encoder_plan, cfg.activation_checkpointing)
        apply_fsdp(encoder, encoder_plan, mesh, policy, reshard_after_forward=cfg.reshard_after_forward)
    return model


def media_router(part: nn.Module, meshes: ParallelMeshes, cfg: ParallelConfig) -> RoutedMediaFn:
    """The router of a pipeline's media (module doc): over ``meshes.media``, the peers of this
    rank's rows the routing ranks of its pipeline (``meshes.pp``, the first stage first)."""
    routing = meshes.media.mesh.flatten().tolist()
    peers = [routing.index(rank) for rank in meshes.pp.mesh.flatten().tolist()]
    config = part.media_config()
    return RoutedMediaFn(meshes.media.get_group(), config.media_kinds(), config.encoder_configs, peers,
                         cfg.encoder_balance, long_items(meshes.media, cfg))


def stage_work_per_unit(parts: list[nn.Module], group: dist.ProcessGroup, device: torch.device) -> list[float]:
    """Forward + backward FLOPs per row element of each rank of ``group`` in its pipeline stages:
    6 x the weights of their linear layers (blocks, the head; embeddings are lookups, hollow
    encoders hold none; attention scores left out), gathered so that every rank knows them all."""
    mine = 6.0 * sum(m.in_features * m.out_features for part in parts for m in part.modules()
                     if isinstance(m, nn.Linear))
    gathered = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, torch.tensor([mine], dtype=torch.float64, device=device), group=group)
    return [float(w) for w in gathered]


class PipelineEncoders:
    """The encoders' forward before a pipeline step and their backward after it (module doc).

    ``part``: this rank's ``encoder_part``; ``media_field``, ``row_length``: the batch contract's
    media field and row length; ``route``: the media router (``media_router``); ``first_stage``:
    this rank runs stage 0 (it splices the features); ``pp``: the pipeline size (the gradient
    scale, see the module doc); ``stage_work``: each routing rank's stage FLOPs per row element
    (``stage_work_per_unit``): the items are placed around the stages' own work, so a pipeline
    whose last stage carries a heavy head leaves the encoder work to the lighter stages instead of
    splitting it evenly.
    """

    def __init__(self, part: nn.Module, media_field: str, row_length: Callable[[dict[str, Any]], int],
                 route: RoutedMediaFn, first_stage: bool, pp: int, device: torch.device,
                 stage_work: list[float] | None = None) -> None:
        self.part, self.field, self.row_length, self.route = part, media_field, row_length, route
        self.stage_work = stage_work
        self.first_stage, self.pp, self.device = first_stage, pp, device
        self.names = list(part.media_config().encoder_configs)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def encode(self, rows: list[dict[str, Any]]) -> list[dict[str, dict]]:
        """Per row, the media kwarg of stage 0 (``{name: {"inputs": {"features": ...}, "positions"}}``;
        meaningful on the first stage's ranks only, which receive every feature row). Called by
        every rank of the pipeline with the same ``rows``, once per step: per modality, the rows'
        items joined make one routed call. Every row gets every modality, zero rows where it holds
        no item: the first stage's inputs then require grad alike on all its data-parallel ranks
        (the schedule infers input-gradient shapes with a backward, which joins the stage's FSDP
        collectives only where some input requires grad). With grad enabled the encoders'
        backward is pending until ``backward``."""
        media = [row.get(self.field) or {} for row in rows]
        loads = None
        if self.stage_work is not None:  # the stages run every row at its padded length, the same on every
            # rank of the group (the pipeline's fixed row size), so every rank places the items alike
            loads = [w * sum(self.row_length(row) for row in rows) for w in self.stage_work]
        placed = media if self.first_stage else [{} for _ in rows]  # where the first stage splices them
        spliced: list[dict[str, dict]] = [{} for _ in rows]
        for name in self.names:
            held = [m[name] for m in media if name in m]
            joined = None
            if held:  # every feature row to the first stage: peer 0
                joined = {"inputs": {k: torch.cat([h["inputs"][k] for h in held]) for k in held[0]["inputs"]},
                          "holders": torch.zeros(sum(h["positions"].numel() for h in held), dtype=torch.long)}
            features = self.route(name, self.part.media_encoder(name), joined,
                                  self.part.media_dummy_inputs(name, self.device), loads)
            leaf = features.detach().requires_grad_(torch.is_grad_enabled())
            if features.requires_grad:  # (not when frozen or without grad)
                self._pending.append((features, leaf))
            start, none = 0, torch.zeros(0, dtype=torch.long, device=self.device)
            for i, row_media in enumerate(placed):
                positions = row_media[name]["positions"] if name in row_media else none
                spliced[i][name] = {"inputs": {"features": leaf[start:start + positions.numel()]},
                                    "positions": positions}
                start += positions.numel()
            if start != features.shape[0]:
                raise ValueError(f"{name}: the encoders produced {features.shape[0]} features for {start} "
                                 "placeholder tokens")
        return spliced

    def backward(self) -> None:
        """The encoders' backward from the gradients the first stage left on the features (zero
        where a feature reached no loss; no rows off the first stage), through the router's
        inverse all-to-all to the ranks that ran each item, one encoder at a time: each is its
        own FSDP root. Every rank takes part."""
        for features, leaf in self._pending:
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            torch.autograd.backward(features, grad * self.pp)
        self._pending = []


class PipelineMedia:
    """The ``StageMedia`` hook of generic pipelining (module doc): which models it concerns,
    their rules, their hollowed stages, the encoder part and the ``PipelineEncoders`` around the
    schedule."""

    def check(self, model: nn.Module, cfg: ParallelConfig, grad_accum: int) -> None:
        """``check_pipeline_media`` as a ``StageHooks`` check (the micro-batch count is no concern of it)."""
        check_pipeline_media(model, cfg)

    def applies(self, model: nn.Module) -> bool:
        return has_media(model)

    def hollow(self, model: nn.Module) -> nn.Module:
        return hollow_encoders(model)

    def part_maker(self, cfg: ParallelConfig, meshes: ParallelMeshes,
                   device: torch.device) -> Callable[[nn.Module], nn.Module]:
        logger.info("media encoders on every pipeline rank (sharded %d-way over %d ranks), their work spread over "
                    "the %d ranks around the schedule", meshes.dims.encoder_shard_size, meshes.dims.encoder_span,
                    meshes.media.size())
        return functools.partial(encoder_part, cfg=cfg, mesh=meshes.encoder_fsdp, device_type=device.type)

    def around_schedule(self, part: nn.Module, stages: list[nn.Module], first_stage: bool, task: Task,
                        cfg: ParallelConfig, meshes: ParallelMeshes, device: torch.device) -> PipelineEncoders:
        route = media_router(part, meshes, cfg)
        return PipelineEncoders(part, task.contract.media, task.contract.row_length, route, first_stage, cfg.pp,
                                device, stage_work_per_unit(stages, route.group, device))
