"""Parallel layout: sizes validated against the world size, then a named DeviceMesh.

``ParallelDims.resolve`` is pure arithmetic so the launcher can reject a bad layout before
any worker starts; ``build_mesh`` runs inside the workers. Later recipes add dimensions
(sp, pp) here; a size-1 dimension costs nothing.

Expert parallelism splits ``dp_shard`` into ``(ep_fsdp, ep)``: with ``ep > 1`` the mesh is built
over those two dimensions and the data-parallel / FSDP mesh is their flattening, so dense
weights are still sharded over every ``dp_shard`` rank (see ``veomni/parallel/expert.py``).
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
    ep: int = 1

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
        if cfg.ep < 1 or dp_shard % cfg.ep:
            raise LayoutError(
                f"parallel.ep={cfg.ep} must be >= 1 and divide the data-parallel shard size {dp_shard} "
                f"(world size {world_size} / dp_replicate {cfg.dp_replicate}); pick a divisor of {dp_shard}"
            )
        if cfg.ep > 1 and cfg.dp_replicate > 1:
            raise LayoutError("parallel.ep > 1 with parallel.dp_replicate > 1 (HSDP) is not supported yet; "
                              "set parallel.dp_replicate=1")
        return cls(dp_replicate=cfg.dp_replicate, dp_shard=dp_shard, world_size=world_size, ep=cfg.ep)

    @property
    def dp_size(self) -> int:
        """Ranks that see different data (and over which the loss is averaged)."""
        return self.dp_replicate * self.dp_shard

    @property
    def ep_fsdp(self) -> int:
        """Ranks holding the same experts, which FSDP-shard them."""
        return self.dp_shard // self.ep

    def describe(self) -> str:
        kind = "HSDP" if self.dp_replicate > 1 else "FSDP"
        text = (
            f"world={self.world_size}  dp_replicate={self.dp_replicate}  dp_shard={self.dp_shard}  ({kind}; "
            f"parameters sharded {self.dp_shard}-way, replicated {self.dp_replicate}-way)"
        )
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
        """1-D shard mesh, or the 2-D (replicate, shard) mesh that makes fully_shard do HSDP."""
        if self.dims.ep > 1:
            return self.dp
        if self.dims.dp_replicate > 1:
            return self.root["dp_replicate", "dp_shard"]
        return self.root["dp_shard"]

    @cached_property
    def dp(self) -> DeviceMesh:
        """All data-parallel ranks flattened: data loading and loss/token reductions."""
        if self.dims.ep > 1:
            return self.root["ep_fsdp", "ep"]._flatten("dp_shard")
        if self.dims.dp_replicate > 1:
            return self.root["dp_replicate", "dp_shard"]._flatten("dp")
        return self.root["dp_shard"]

    @property
    def ep(self) -> DeviceMesh | None:
        """The ranks that together hold every expert (None without expert parallelism)."""
        return self.root["ep"] if self.dims.ep > 1 else None

    @property
    def ep_fsdp(self) -> DeviceMesh | None:
        """The ranks holding the same experts, over which FSDP shards them."""
        return self.root["ep_fsdp"] if self.dims.ep > 1 else None

    @property
    def dp_rank(self) -> int:
        return self.dp.get_local_rank()


def build_mesh(dims: ParallelDims, device_type: str) -> ParallelMeshes:
    if dims.ep > 1:
        root = init_device_mesh(device_type, (dims.ep_fsdp, dims.ep), mesh_dim_names=("ep_fsdp", "ep"))
        return ParallelMeshes(dims=dims, root=root)
    root = init_device_mesh(
        device_type, (dims.dp_replicate, dims.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
    )
    return ParallelMeshes(dims=dims, root=root)
