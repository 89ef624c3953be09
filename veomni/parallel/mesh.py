"""Parallel layout: sizes validated against the world size, then a named DeviceMesh.

``ParallelDims.resolve`` is pure arithmetic so the launcher can reject a bad layout before
any worker starts; ``build_mesh`` runs inside the workers. Later recipes add dimensions
(sp, ep, pp) here; a size-1 dimension costs nothing.
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

    @classmethod
    def resolve(cls, cfg: ParallelConfig, world_size: int) -> "ParallelDims":
        if world_size < 1:
            raise LayoutError(f"world size must be >= 1, got {world_size}")
        if cfg.dp_replicate < 1:
            raise LayoutError(f"parallel.dp_replicate must be >= 1, got {cfg.dp_replicate}")
        others = cfg.dp_replicate
        if world_size % others:
            raise LayoutError(
                f"parallel.dp_replicate={cfg.dp_replicate} does not divide the world size {world_size}; "
                f"pick a divisor of {world_size}"
            )
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            dp_shard = world_size // others
        if dp_shard < 1 or others * dp_shard != world_size:
            raise LayoutError(
                f"parallel.dp_replicate ({cfg.dp_replicate}) x parallel.dp_shard ({cfg.dp_shard}) = "
                f"{others * cfg.dp_shard} but the world size is {world_size}; set parallel.dp_shard to "
                f"{world_size // others} or -1 (take the remaining ranks)"
            )
        return cls(dp_replicate=cfg.dp_replicate, dp_shard=dp_shard, world_size=world_size)

    @property
    def dp_size(self) -> int:
        """Ranks that see different data (and over which the loss is averaged)."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        kind = "HSDP" if self.dp_replicate > 1 else "FSDP"
        return (
            f"world={self.world_size}  dp_replicate={self.dp_replicate}  dp_shard={self.dp_shard}  ({kind}; "
            f"parameters sharded {self.dp_shard}-way, replicated {self.dp_replicate}-way)"
        )


@dataclass
class ParallelMeshes:
    """The named mesh and the sub-meshes each part of the engine uses."""

    dims: ParallelDims
    root: DeviceMesh

    @cached_property
    def fsdp(self) -> DeviceMesh:
        """1-D shard mesh, or the 2-D (replicate, shard) mesh that makes fully_shard do HSDP."""
        if self.dims.dp_replicate > 1:
            return self.root["dp_replicate", "dp_shard"]
        return self.root["dp_shard"]

    @cached_property
    def dp(self) -> DeviceMesh:
        """All data-parallel ranks flattened: data loading and loss/token reductions."""
        if self.dims.dp_replicate > 1:
            return self.root["dp_replicate", "dp_shard"]._flatten("dp")
        return self.root["dp_shard"]

    @property
    def dp_rank(self) -> int:
        return self.dp.get_local_rank()


def build_mesh(dims: ParallelDims, device_type: str) -> ParallelMeshes:
    root = init_device_mesh(
        device_type, (dims.dp_replicate, dims.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
    )
    return ParallelMeshes(dims=dims, root=root)
