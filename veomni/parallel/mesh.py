"""Parallel layout: sizes validated against the world size, then named DeviceMeshes.

``ParallelDims.resolve`` is pure arithmetic so the launcher can reject a bad layout before
any worker starts; ``build_mesh`` runs inside the workers. A size-1 dimension costs nothing.

The root mesh is ``(pp, dp_replicate, dp_shard, sp)``: pipeline stages outermost, so each
pipeline stage is a full data/sequence-parallel layout of its own (``pp`` x the rest). Parameters are sharded over
``dp_shard x sp`` (SP ranks hold different tokens, so they shard like data ranks). Expert
parallelism splits those same ``dp_shard x sp`` ranks into ``(ep_fsdp, ep)``: consecutive
groups of ``ep`` ranks hold all experts between them, and the ``ep_fsdp`` ranks holding the
same experts FSDP-shard them (see ``veomni/parallel/expert.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from veomni.config.schema import ParallelConfig


class LayoutError(ValueError):
    """The parallel sizes do not fit the world size; the message says how to fix them."""


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int
    sp: int = 1
    ep: int = 1
    pp: int = 1

    @classmethod
    def resolve(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        if world_size < 1:
            raise LayoutError(f"world size must be >= 1, got {world_size}")
        if cfg.pp < 1 or world_size % cfg.pp:
            raise LayoutError(f"parallel.pp={cfg.pp} must be >= 1 and divide the world size {world_size}; "
                              f"pick a divisor of {world_size}")
        total_world, world_size = world_size, world_size // cfg.pp  # the ranks of one pipeline stage
        for name in ("dp_replicate", "sp"):
            value = getattr(cfg, name)
            if value < 1:
                raise LayoutError(f"parallel.{name} must be >= 1, got {value}")
            if world_size % value:
                raise LayoutError(f"parallel.{name}={value} does not divide the world size {world_size}; "
                                  f"pick a divisor of {world_size}")
        others = cfg.dp_replicate * cfg.sp
        if world_size % others:
            raise LayoutError(f"parallel.dp_replicate x parallel.sp = {others} does not divide the world size "
                              f"{world_size}" + (f" / parallel.pp {cfg.pp}" if cfg.pp > 1 else ""))
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            dp_shard = world_size // others
        if dp_shard < 1 or others * dp_shard != world_size:
            raise LayoutError(
                f"parallel.dp_replicate ({cfg.dp_replicate}) x parallel.dp_shard ({cfg.dp_shard}) x parallel.sp "
                f"({cfg.sp}) = {others * cfg.dp_shard} but the world size is {world_size}; set parallel.dp_shard "
                f"to {world_size // others} or -1 (take the remaining ranks)"
            )
        shard_ranks = dp_shard * cfg.sp
        if cfg.ep < 1 or shard_ranks % cfg.ep:
            raise LayoutError(
                f"parallel.ep={cfg.ep} must be >= 1 and divide the parameter-sharding ranks dp_shard x sp = "
                f"{shard_ranks} (world size {world_size} / dp_replicate {cfg.dp_replicate}); pick a divisor of "
                f"{shard_ranks}"
            )
        if cfg.ep > 1 and cfg.dp_replicate > 1:
            raise LayoutError("parallel.ep > 1 with parallel.dp_replicate > 1 (HSDP) is not supported yet; "
                              "set parallel.dp_replicate=1")
        return cls(dp_replicate=cfg.dp_replicate, dp_shard=dp_shard, world_size=total_world, sp=cfg.sp, ep=cfg.ep,
                   pp=cfg.pp)

    @property
    def dp_size(self) -> int:
        """Ranks that read different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def loss_size(self) -> int:
        """Ranks whose token losses make up one step's loss (dp x sp); FSDP averages dense
        gradients over exactly these ranks."""
        return self.dp_size * self.sp

    @property
    def ep_fsdp(self) -> int:
        """Ranks holding the same experts, which FSDP-shard them."""
        return self.dp_shard * self.sp // self.ep

    def describe(self) -> str:
        kind = "HSDP" if self.dp_replicate > 1 else "FSDP"
        sp = f"  sp={self.sp} (Ulysses)" if self.sp > 1 else ""
        text = (
            f"world={self.world_size}  dp_replicate={self.dp_replicate}  dp_shard={self.dp_shard}{sp}  ({kind}; "
            f"parameters sharded {self.dp_shard * self.sp}-way, replicated {self.dp_replicate}-way)"
        )
        if self.pp > 1:
            text += f"  pp={self.pp} (pipeline stages, each over {self.world_size // self.pp} ranks)"
        if self.ep > 1:
            text += f"  ep={self.ep} (experts split {self.ep}-way, each slice FSDP-sharded {self.ep_fsdp}-way)"
        return text


@dataclass
class ParallelMeshes:
    """The named mesh and the sub-meshes each part of the engine uses."""

    dims: ParallelDims
    root: DeviceMesh

    @cached_property
    def fsdp(self) -> DeviceMesh:
        """The shard mesh (dp_shard x sp), 2-D with dp_replicate in front for HSDP."""
        if self.dims.dp_replicate > 1:
            # A mesh of its own over the same rank order: slicing a flattened dim back out
            # of the root mesh is deprecated.
            mesh = init_device_mesh(self.root.device_type,
                                    (self.dims.pp, self.dims.dp_replicate, self.dims.dp_shard * self.dims.sp),
                                    mesh_dim_names=("pp", "dp_replicate", "dp_shard_sp"))
            return mesh["dp_replicate", "dp_shard_sp"]
        return self.root["dp_shard", "sp"]._flatten("dp_shard_sp")

    @cached_property
    def dp(self) -> DeviceMesh:
        """Ranks that read different data (dp_replicate x dp_shard)."""
        return self.root["dp_replicate", "dp_shard"]._flatten("dp")

    @cached_property
    def loss(self) -> DeviceMesh:
        """Every rank holding part of the step's tokens (dp x sp): loss, token and expert-load
        reductions."""
        return self.root["dp_replicate", "dp_shard", "sp"]._flatten("loss")

    @cached_property
    def sp(self) -> DeviceMesh:
        return self.root["sp"]

    @cached_property
    def pp(self) -> DeviceMesh:
        """The ranks holding the successive pipeline stages of the same data."""
        return self.root["pp"]

    @cached_property
    def _experts(self) -> DeviceMesh | None:
        """(ep_fsdp, ep) over the dp_shard x sp ranks, in the root's rank order."""
        if self.dims.ep == 1:
            return None
        mesh = init_device_mesh(self.root.device_type, (self.dims.pp, self.dims.ep_fsdp, self.dims.ep),
                                mesh_dim_names=("pp", "ep_fsdp", "ep"))
        return mesh["ep_fsdp", "ep"]

    @property
    def ep(self) -> DeviceMesh | None:
        """The ranks that together hold every expert (None without expert parallelism)."""
        return self._experts["ep"] if self._experts is not None else None

    @property
    def ep_fsdp(self) -> DeviceMesh | None:
        """The ranks holding the same experts, over which FSDP shards them."""
        return self._experts["ep_fsdp"] if self._experts is not None else None

    @property
    def dp_rank(self) -> int:
        return self.dp.get_local_rank()


def build_mesh(dims: ParallelDims, device_type: str) -> ParallelMeshes:
    root = init_device_mesh(
        device_type, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.sp),
        mesh_dim_names=("pp", "dp_replicate", "dp_shard", "sp")
    )
    return ParallelMeshes(dims=dims, root=root)
