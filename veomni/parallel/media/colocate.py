"""Encoder-LLM colocation on the model side: the ``MediaFn`` that routes an omni model's media
through ``route.route_media``, and the recipe that installs it.

With a dynamic image:text mix one rank's micro-batch may hold most of the step's images and the
others wait for it (``parallel.encoder_balance`` spreads the items by encoder cost); one huge
image may outweigh everything else (``parallel.encoder_sp`` runs it sequence-parallel over a
block of ranks); under LLM sequence parallelism every rank of a row holds the same media but needs
only the features of its slice's placeholders. ``RoutedMediaFn`` covers all three.

Its ``peers`` are the group ranks that hold one row (the ``sp`` ranks splitting it, in row-rank
order; one rank without sequence parallelism). The row's media entry then says which row rank
holds each feature row (``holders``, set by the VLM contract when the row is sharded); the peers
split the row's items between them by encoder cost (no communication: they all see the same
items), announce their share, and each receives exactly the rows of its slice. A pipeline that
colocates its encoders uses the same router with the pipeline ranks of a data-parallel group as
the peers and every row destined to the first stage (``pipeline_encoders.media_router``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from veomni.config.schema import ParallelConfig
from veomni.contract.media import MediaHost, MediaKind
from veomni.parallel.media.assign import assign_items
from veomni.parallel.media.encoder_sp import apply_encoder_sp, check_encoder_sp
from veomni.parallel.media.route import LongItems, route_media
from veomni.parallel.mesh import ParallelMeshes

logger = logging.getLogger(__name__)


class RoutedMediaFn:
    """The ``MediaFn`` over ``route_media``: each row's items are split between the ranks holding
    the row (``peers``: their ranks in ``group``, in row-rank order) by encoder cost, and each rank
    of the row receives the features of the placeholders in its slice (the media entry's
    ``holders``: the row rank of each feature row; absent when the row is not split). With
    ``balance`` the items then spread over the whole ``group`` by cost; with ``long``, items
    longer than its threshold run sequence-parallel over blocks of the group's ranks."""

    def __init__(self, group: dist.ProcessGroup, kinds: Mapping[str, MediaKind],
                 encoder_configs: Mapping[str, Any], peers: Sequence[int], balance: bool,
                 long: LongItems | None = None) -> None:
        self.group = group
        self.kinds = kinds
        self.encoder_configs = encoder_configs
        self.peers = list(peers)
        self.row_rank = self.peers.index(dist.get_rank(group))
        self.balance = balance
        self.long = long

    def __call__(self, name: str, encoder: nn.Module, media: Mapping[str, Any] | None,
                 dummy_inputs: Mapping[str, torch.Tensor], loads: Sequence[float] | None = None) -> torch.Tensor:
        """``loads`` (a pipeline's call, not the model's): other work each rank of the group has in
        the step, which the items are placed around."""
        kind = self.kinds[name]
        items = kind.split(media["inputs"], self.encoder_configs[name]) if media is not None else []
        rows = sum(item.num_tokens for item in items)
        holders = media.get("holders") if media is not None else torch.zeros(0, dtype=torch.long)
        if holders is None:
            if len(self.peers) > 1:
                raise ValueError(f"{name}: the row is split over {len(self.peers)} ranks but its media entry has "
                                 "no 'holders'; shard the batch with veomni.parallel.row_split.shard_batch")
            holders = torch.zeros(rows, dtype=torch.long)
        holders = holders.cpu()
        costs = [kind.flops(encoder, item.inputs) for item in items]
        announcer = assign_items([costs] + [[] for _ in self.peers[1:]],
                                 None if loads is None else [loads[p] for p in self.peers])[0]
        starts = [0, *torch.tensor([item.num_tokens for item in items], dtype=torch.long).cumsum(0).tolist()]
        peers = torch.tensor(self.peers, dtype=torch.long)
        mine = [i for i, a in enumerate(announcer) if a == self.row_rank]
        features = route_media(self.group, encoder, [items[i] for i in mine], [costs[i] for i in mine],
                               [peers[holders[starts[i]:starts[i + 1]]] for i in mine], self.balance, dummy_inputs,
                               self.long, loads)
        # canonical order (announcer's group rank, item, row) -> the row order of this slice's positions
        received = [row for a in sorted(range(len(self.peers)), key=self.peers.__getitem__)
                    for i in range(len(items)) if announcer[i] == a
                    for row in range(starts[i], starts[i + 1]) if holders[row] == self.row_rank]
        return features[torch.tensor(received, dtype=torch.long).argsort().to(features.device)]


def check_media_routing(model: nn.Module, cfg: ParallelConfig) -> list[str]:
    """Why ``parallel.encoder_balance`` / ``encoder_sp`` cannot apply to this model and layout
    (empty when they can); sizes against the world are ``ParallelDims.resolve``'s."""
    asked = [f"parallel.{k}" for k, on in (("encoder_balance", cfg.encoder_balance),
                                           ("encoder_sp", cfg.encoder_sp > 1)) if on]
    if not asked:
        return []
    if not isinstance(model, MediaHost):
        return [f"{' and '.join(asked)}: {type(model).__name__} runs no media encoders; remove the key"]
    if cfg.cp > 1:
        return [f"{' and '.join(asked)} with parallel.cp={cfg.cp} is not supported yet: the routed features would "
                "have to reach the ranks holding their context-parallel pieces; use data, sequence (parallel.sp) or "
                f"pipeline parallelism, or turn {' and '.join(asked)} off"]
    if cfg.pp > 1 and not cfg.encoder_colocate:
        return [f"{' and '.join(asked)} with parallel.pp={cfg.pp} and parallel.encoder_colocate=false: inline, the "
                "first stage runs the encoders inside the schedule, one micro-batch at a time, where no other rank "
                "can take its items; set parallel.encoder_colocate=true (the encoders then run on every pipeline "
                f"rank, around the schedule) or turn {' and '.join(asked)} off"]
    return check_encoder_sp(model, cfg.encoder_sp, cfg.encoder_sp_threshold)


def long_items(mesh: DeviceMesh, cfg: ParallelConfig) -> LongItems | None:
    """Long-short sequence parallelism over the routing group ``mesh`` (``ParallelMeshes.media``):
    blocks of ``parallel.encoder_sp`` consecutive ranks of it; None when off. ``mesh`` spans
    every rank in rank order (without a pipeline the loss ranks, with one every pp x dp rank), so
    the blocks are cut from the world, which every rank builds alike."""
    if cfg.encoder_sp == 1:
        return None
    if mesh.mesh.flatten().tolist() != list(range(dist.get_world_size())):
        raise ValueError(f"encoder_sp blocks: the routing group {mesh.mesh.tolist()} must hold every rank in order")
    blocks = init_device_mesh(mesh.device_type, (mesh.size() // cfg.encoder_sp, cfg.encoder_sp),
                              mesh_dim_names=("encoder_sp_blocks", "encoder_sp"))
    return LongItems(cfg.encoder_sp_threshold, cfg.encoder_sp, blocks["encoder_sp"].get_group())


def apply_media_routing(model: nn.Module, meshes: ParallelMeshes, cfg: ParallelConfig) -> None:
    """Install ``RoutedMediaFn`` where media must move: over the sequence-parallel group when rows
    are split (each rank encodes a share of its row's items and receives its slice's features),
    over every rank holding part of the step (``meshes.media``: dp x sp) with balancing or
    long-short sequence parallelism (``parallel.encoder_sp`` blocks of consecutive ranks); one
    rank and neither keeps the local default."""
    if not isinstance(model, MediaHost):
        raise ValueError(f"media routing: {type(model).__name__} runs no media encoders")
    dims = meshes.dims
    if dims.cp > 1 or dims.pipeline_encoders:
        raise ValueError("media routing in the model: not under context parallelism (check_sequence_parallel) nor "
                         "where a pipeline routes the media around its schedule (media/pipeline_encoders.py)")
    long = long_items(meshes.media, cfg)
    if long is not None:
        apply_encoder_sp(model)
    if (cfg.encoder_balance or long is not None) and dims.loss_size > 1:
        mesh = meshes.media
        first = mesh.get_local_rank() - meshes.sp.get_local_rank()  # loss ranks run (dp, sp), sp innermost
        peers = range(first, first + dims.sp)
    elif dims.sp > 1:
        mesh, peers = meshes.sp, range(dims.sp)
    else:
        logger.info("parallel.encoder_balance: one data-parallel rank, nothing to balance")
        return
    config = model.media_config()
    model.media_fn = RoutedMediaFn(mesh.get_group(), config.media_kinds(), config.encoder_configs, peers,
                                   cfg.encoder_balance, long)
    how = ["balanced by encoder cost" if cfg.encoder_balance else f"split between the {dims.sp} ranks of each row"]
    if long is not None:
        how.append(f"items over {long.threshold} encoder rows sequence-parallel over {long.size} ranks")
    logger.info("media encoders (%s) routed over %d ranks: %s", ", ".join(config.encoder_configs), mesh.size(),
                "; ".join(how))
