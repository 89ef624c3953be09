"""Parallel layout: sizes validated against the world size, then named DeviceMeshes.

``ParallelDims.resolve`` is pure arithmetic so the launcher can reject a bad layout before
any worker starts; ``build_mesh`` runs inside the workers. A size-1 dimension costs nothing.

The root mesh is ``(pp, dp_replicate, dp_shard, cp, sp)``: pipeline stages outermost, so each
pipeline stage is a full data/sequence-parallel layout of its own (``pp`` x the rest); Ulysses
(``sp``) innermost, on the fastest links, context parallelism (``cp``) around it. Parameters are
sharded over ``dp_shard x cp x sp`` (those ranks hold different tokens, so they shard like data
ranks). Expert parallelism splits those same ranks into ``(ep_fsdp, ep)``: consecutive groups of
``ep`` ranks hold all experts between them, and the ``ep_fsdp`` ranks holding the same experts
FSDP-shard them (see ``veomni/parallel/expert.py``). The cp ranks form Mesh-Attention's
``b x a`` tile grid (``context.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from veomni.config.schema import ParallelConfig
from veomni.errors import BadConfig
from veomni.parallel.context import MeshGroups
from veomni.parallel.row_split import RowSplit


class LayoutError(BadConfig):
    """The parallel sizes do not fit the world size; the message says how to fix them."""


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int
    sp: int = 1
    ep: int = 1
    pp: int = 1
    cp: int = 1
    cp_mesh: tuple[int, int] | None = None
    """Mesh-Attention's (a, b); None: chosen in the workers (``cp_cost.choose_cp_mesh``)."""
    encoder_shard: int = 0
    """Ranks sharding each media encoder (``parallel.encoder_fsdp``); 0: the default of
    ``encoder_shard_size``."""
    pipeline_encoders: bool = False
    """A pipeline colocates media encoders on all its ranks (``parallel.pp`` > 1 with
    ``parallel.encoder_colocate``): their work and their FSDP mesh span every pp x dp rank
    (``media/pipeline_encoders.py``)."""

    @classmethod
    def resolve(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        if world_size < 1:
            raise LayoutError(f"world size must be >= 1, got {world_size}")
        if cfg.pp < 1 or world_size % cfg.pp:
            raise LayoutError(f"parallel.pp={cfg.pp} must be >= 1 and divide the world size {world_size}; "
                              f"pick a divisor of {world_size}")
        total_world, world_size = world_size, world_size // cfg.pp  # the ranks of one pipeline stage
        for name in ("dp_replicate", "cp", "sp"):
            value = getattr(cfg, name)
            if value < 1:
                raise LayoutError(f"parallel.{name} must be >= 1, got {value}")
            if world_size % value:
                stage = (f"the ranks of one pipeline stage, world size {total_world} / parallel.pp={cfg.pp} = "
                         f"{world_size}" if cfg.pp > 1 else f"the world size {world_size}")
                raise LayoutError(f"parallel.{name}={value} does not divide {stage}; pick a divisor of "
                                  f"{world_size}" + (f", or lower parallel.pp so that parallel.pp x parallel.{name} "
                                                     f"divides {total_world}" if cfg.pp > 1 else ""))
        others = cfg.dp_replicate * cfg.cp * cfg.sp
        if world_size % others:
            raise LayoutError(f"parallel.dp_replicate x parallel.cp x parallel.sp = {others} does not divide the "
                              f"world size {world_size}" + (f" / parallel.pp {cfg.pp}" if cfg.pp > 1 else ""))
        cp_mesh = _resolve_cp_mesh(cfg.cp_mesh, cfg.cp)
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            dp_shard = world_size // others
        if dp_shard < 1 or others * dp_shard != world_size:
            raise LayoutError(
                f"parallel.dp_replicate ({cfg.dp_replicate}) x parallel.dp_shard ({cfg.dp_shard}) x parallel.cp "
                f"({cfg.cp}) x parallel.sp ({cfg.sp}) = {others * cfg.dp_shard} but the world size is {world_size}; "
                f"set parallel.dp_shard "
                f"to {world_size // others} or -1 (take the remaining ranks)"
            )
        shard_ranks = dp_shard * cfg.cp * cfg.sp
        if cfg.ep < 1 or shard_ranks % cfg.ep:
            raise LayoutError(
                f"parallel.ep={cfg.ep} must be >= 1 and divide the parameter-sharding ranks dp_shard x cp x sp = "
                f"{shard_ranks} (world size {world_size} / dp_replicate {cfg.dp_replicate}); pick a divisor of "
                f"{shard_ranks}"
            )
        if cfg.ep > 1 and cfg.dp_replicate > 1:
            raise LayoutError("parallel.ep > 1 with parallel.dp_replicate > 1 (HSDP) is not supported yet; "
                              "set parallel.dp_replicate=1")
        pipeline_encoders = cfg.pp > 1 and cfg.encoder_colocate
        # the ranks sharing media encoder work: a stage's dp x sp, or every rank of a colocating pipeline
        media_ranks, where = ((total_world, "pp x dp: the pipeline colocates them") if pipeline_encoders
                              else (cfg.dp_replicate * dp_shard * cfg.sp, "dp x sp of a stage"))
        if cfg.encoder_sp < 1:
            raise LayoutError(f"parallel.encoder_sp must be >= 1 (1: every media item runs whole on one rank), "
                              f"got {cfg.encoder_sp}")
        if media_ranks % cfg.encoder_sp:
            raise LayoutError(f"parallel.encoder_sp={cfg.encoder_sp} must divide the {media_ranks} ranks that share "
                              f"media encoder work ({where}; long items run on blocks of encoder_sp of them); pick "
                              f"a divisor of {media_ranks}")
        # the ranks one encoder shard group may span: a stage's sharding ranks, or every rank of a colocating pipeline
        shardable, which, default = ((total_world, "the pp x dp ranks the pipeline colocates them on", "all of them")
                                     if pipeline_encoders
                                     else (shard_ranks, "the parameter-sharding ranks dp_shard x cp x sp", "the LLM's"))
        if cfg.encoder_fsdp < 0 or (cfg.encoder_fsdp and shardable % cfg.encoder_fsdp):
            divisors = [d for d in range(1, shardable + 1) if shardable % d == 0]
            raise LayoutError(f"parallel.encoder_fsdp={cfg.encoder_fsdp} must divide {which} = {shardable}; pick "
                              f"one of {divisors} (or 0: {default})")
        return cls(dp_replicate=cfg.dp_replicate, dp_shard=dp_shard, world_size=total_world, sp=cfg.sp, ep=cfg.ep,
                   pp=cfg.pp, cp=cfg.cp, cp_mesh=cp_mesh, encoder_shard=cfg.encoder_fsdp,
                   pipeline_encoders=pipeline_encoders)

    @property
    def dp_size(self) -> int:
        """Ranks that read different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def row_ranks(self) -> int:
        """Ranks that split one packed row (cp x sp)."""
        return self.cp * self.sp

    @property
    def shard_size(self) -> int:
        """Ranks that shard the parameters (dp_shard x cp x sp)."""
        return self.dp_shard * self.row_ranks

    @property
    def loss_size(self) -> int:
        """Ranks whose token losses make up one step's loss (dp x cp x sp); FSDP averages dense
        gradients over exactly these ranks."""
        return self.dp_size * self.row_ranks

    @property
    def ep_fsdp(self) -> int:
        """Ranks holding the same experts, which FSDP-shard them."""
        return self.shard_size // self.ep

    @property
    def encoder_span(self) -> int:
        """Ranks each media encoder's FSDP mesh spans (sharded ``encoder_shard_size``-way,
        replicated over the rest): a stage's ranks, or every rank when a pipeline colocates the
        encoders."""
        return self.world_size if self.pipeline_encoders else self.world_size // self.pp

    @property
    def encoder_shard_size(self) -> int:
        """Ranks sharding each media encoder: ``encoder_shard``, else the LLM's ``shard_size``
        (all of ``encoder_span`` when a pipeline colocates the encoders)."""
        return self.encoder_shard or (self.encoder_span if self.pipeline_encoders else self.shard_size)

    @property
    def encoders_own_mesh(self) -> bool:
        """The stages' ``parallelize`` shards media encoders on ``ParallelMeshes.encoder_fsdp``, not
        with the LLM's blocks (with colocating pipelines the stages hold no encoders)."""
        return not self.pipeline_encoders and self.encoder_shard_size != self.shard_size

    def describe(self) -> str:
        kind = "HSDP" if self.dp_replicate > 1 else "FSDP"
        cp = ""
        if self.cp > 1:
            shape = "auto" if self.cp_mesh is None else \
                "ring" if self.cp_mesh[0] == 1 else f"Mesh-Attention {self.cp_mesh[0]}x{self.cp_mesh[1]}"
            cp = f"  cp={self.cp} ({shape})"
        sp = f"  sp={self.sp} (Ulysses)" if self.sp > 1 else ""
        text = (
            f"world={self.world_size}  dp_replicate={self.dp_replicate}  dp_shard={self.dp_shard}{cp}{sp}  ({kind}; "
            f"parameters sharded {self.shard_size}-way, replicated {self.dp_replicate}-way)"
        )
        if self.pp > 1:
            text += f"  pp={self.pp} (pipeline stages, each over {self.world_size // self.pp} ranks)"
        if self.encoder_shard:
            text += f"  media encoders sharded {self.encoder_shard_size}-way over {self.encoder_span} ranks"
        if self.ep > 1:
            text += f"  ep={self.ep} (experts split {self.ep}-way, each slice FSDP-sharded {self.ep_fsdp}-way)"
        return text


def _resolve_cp_mesh(cp_mesh: list[int], cp: int) -> tuple[int, int] | None:
    if not cp_mesh:
        return (1, 1) if cp == 1 else None
    shapes = ", ".join(f"[{a}, {cp // a}]" for a in range(1, cp + 1) if cp % a == 0)
    if len(cp_mesh) != 2 or min(cp_mesh) < 1 or cp_mesh[0] * cp_mesh[1] != cp:
        raise LayoutError(f"parallel.cp_mesh={list(cp_mesh)} must be [a, b] with a x b = parallel.cp ({cp}): one of "
                          f"{shapes} ([1, {cp}] is ring attention), or [] to choose automatically")
    return cp_mesh[0], cp_mesh[1]


@dataclass
class ParallelMeshes:
    """The named mesh and the sub-meshes each part of the engine uses."""

    dims: ParallelDims
    root: DeviceMesh

    @cached_property
    def fsdp(self) -> DeviceMesh:
        """The shard mesh (dp_shard x cp x sp), 2-D with dp_replicate in front for HSDP."""
        if self.dims.dp_replicate > 1:
            # A mesh of its own over the same rank order: slicing a flattened dim back out
            # of the root mesh is deprecated.
            mesh = init_device_mesh(self.root.device_type,
                                    (self.dims.pp, self.dims.dp_replicate, self.dims.shard_size),
                                    mesh_dim_names=("pp", "dp_replicate", "dp_shard_cp_sp"))
            return mesh["dp_replicate", "dp_shard_cp_sp"]
        return self.root["dp_shard", "cp", "sp"]._flatten("dp_shard_cp_sp")

    @cached_property
    def encoder_fsdp(self) -> DeviceMesh:
        """The media encoders' FSDP mesh: ``(replicate, shard)`` over ``dims.encoder_span`` ranks
        (those of ``fsdp``, or every rank when a pipeline colocates the encoders), the shard
        groups ``encoder_shard_size`` consecutive ranks; one dimension (``fsdp``, or ``media``
        under such a pipeline) when they shard like the default. FSDP averages gradients over
        all of its ranks."""
        d = self.dims
        if d.pipeline_encoders and d.encoder_shard_size == d.encoder_span:
            return self.media
        if not d.pipeline_encoders and d.encoder_shard_size == d.shard_size:
            return self.fsdp
        stages = d.world_size // d.encoder_span  # the pipeline stages' ranks hold separate encoders when inline
        mesh = init_device_mesh(self.root.device_type,
                                (stages, d.encoder_span // d.encoder_shard_size, d.encoder_shard_size),
                                mesh_dim_names=("encoder_stage", "encoder_replicate", "encoder_shard"))
        return mesh["encoder_replicate", "encoder_shard"]

    @cached_property
    def media(self) -> DeviceMesh:
        """Every rank sharing the step's media encoder work (the routing group of
        ``colocate.py``): the ranks holding part of the step's tokens (``loss``), or every
        pipeline x data-parallel rank when a pipeline colocates the encoders (cp = sp = 1 there,
        ``pipeline_encoders.check_pipeline_media``)."""
        if self.dims.pipeline_encoders:
            return self.root["pp", "dp_replicate", "dp_shard"]._flatten("media")
        return self.loss

    @cached_property
    def dp(self) -> DeviceMesh:
        """Ranks that read different data (dp_replicate x dp_shard)."""
        return self.root["dp_replicate", "dp_shard"]._flatten("dp")

    @cached_property
    def loss(self) -> DeviceMesh:
        """Every rank holding part of the step's tokens (dp x cp x sp): loss, token and expert-load
        reductions."""
        return self.root["dp_replicate", "dp_shard", "cp", "sp"]._flatten("loss")

    @cached_property
    def sp(self) -> DeviceMesh:
        return self.root["sp"]

    @cached_property
    def cp(self) -> DeviceMesh:
        return self.root["cp"]

    @cached_property
    def row(self) -> DeviceMesh:
        """The ranks holding pieces of one packed row (cp x sp): sums along a row are completed over it."""
        return self.root["cp", "sp"]._flatten("row")

    @property
    def row_split(self) -> RowSplit:
        """Where this rank's positions of each packed row are (``row_split.py``)."""
        return RowSplit(sp_rank=self.sp.get_local_rank(), sp=self.dims.sp, cp_rank=self.cp.get_local_rank(),
                        cp=self.dims.cp)

    def cp_groups(self, a: int, b: int) -> MeshGroups:
        """Mesh-Attention's groups for an ``a x b`` tile grid of the cp ranks: rows of ``a``
        consecutive cp ranks, columns (the key/value rings) of ``b``."""
        d = self.dims
        mesh = init_device_mesh(self.root.device_type, (d.pp, d.dp_replicate, d.dp_shard, b, a, d.sp),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp_kv", "cp_q", "sp"))
        return MeshGroups(self.cp.get_local_rank(), a, b, mesh["cp_q"].get_group() if a > 1 else None,
                          mesh["cp_kv"].get_group() if b > 1 else None)

    @cached_property
    def pp(self) -> DeviceMesh:
        """The ranks holding the successive pipeline stages of the same data."""
        return self.root["pp"]

    @cached_property
    def _experts(self) -> DeviceMesh | None:
        """(ep_fsdp, ep) over the dp_shard x cp x sp ranks, in the root's rank order."""
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

    def dp_rank_lists(self) -> list[list[int]]:
        """Every data-parallel group as its global ranks in data-parallel order (one group per pipeline
        stage and cp x sp position): for groups every rank must create alike."""
        return self.root.mesh.permute(0, 3, 4, 1, 2).reshape(-1, self.dims.dp_size).tolist()


def build_mesh(dims: ParallelDims, device_type: str) -> ParallelMeshes:
    root = init_device_mesh(
        device_type, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.sp),
        mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "sp")
    )
    return ParallelMeshes(dims=dims, root=root)
