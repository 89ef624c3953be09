"""FSDP2: shard every plan block, then the root; HSDP when the mesh is 2-D.

With expert parallelism the grouped-expert modules are sharded first, on their own mesh
(the ranks holding the same experts), so the blocks' FSDP units skip their weights. Media
encoders given a mesh of their own (``parallel.encoder_fsdp``) are sharded on it next, blocks
then the encoder itself, so the root's unit skips them too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from veomni.contract.plan import ParallelPlan, match_modules

logger = logging.getLogger(__name__)


def mixed_precision_policy(mode: str, device_type: str) -> MixedPrecisionPolicy:
    """``auto`` is bf16 compute with fp32 gradient reduction on GPU and plain fp32 on CPU,
    where bf16 backward is emulated and several times slower."""
    if mode == "bf16" or (mode == "auto" and device_type == "cuda"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def check_encoder_fsdp(model: nn.Module, encoder_fsdp: int) -> list[str]:
    """Why ``parallel.encoder_fsdp`` cannot apply to this model (empty when it can); its size is
    checked against the layout by ``ParallelDims.resolve``."""
    if encoder_fsdp and not model.parallel_plan().encoders:
        return [f"parallel.encoder_fsdp={encoder_fsdp}: {type(model).__name__} declares no encoders in its "
                "parallel plan; remove the key"]
    return []


def apply_fsdp(
    model: nn.Module,
    plan: ParallelPlan,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    experts: Sequence[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
    encoders: Sequence[str] = (),
    encoder_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """``experts`` (already split over the EP mesh) are sharded over ``expert_mesh`` on dim 1,
    the per-expert output dim, since dim 0 is the expert dim EP already splits (as VeOmni does).
    ``encoders`` (module paths) are sharded over ``encoder_mesh`` when it is given."""
    offload: OffloadPolicy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for module in experts:
        fully_shard(module, mesh=expert_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
                    offload_policy=offload, shard_placement_fn=lambda _param: Shard(1))
    own = tuple(encoders) if encoder_mesh is not None else ()
    blocks = match_modules(model, plan.blocks)
    for name, block in blocks:
        inside = any(name.startswith(path + ".") for path in own)
        fully_shard(block, mesh=encoder_mesh if inside else mesh, mp_policy=mp_policy,
                    reshard_after_forward=reshard_after_forward, offload_policy=offload)
    for path in own:
        fully_shard(model.get_submodule(path), mesh=encoder_mesh, mp_policy=mp_policy,
                    reshard_after_forward=reshard_after_forward, offload_policy=offload)
    # The root keeps its parameters (embeddings, final norm, head) gathered after forward:
    # backward needs them right away, so resharding would only add an all-gather.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False, offload_policy=offload)
    logger.info("FSDP2 applied to %d expert groups, %d blocks + root over mesh %s%s", len(experts), len(blocks), mesh,
                f"; encoders {', '.join(own)} over mesh {encoder_mesh}" if own else "")
    return model
