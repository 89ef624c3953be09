"""The one ordered parallel recipe applied to a plain model.

Order matters: pipeline split (``pipeline/stages.py`` cuts the model before calling this) -> sequence,
graph, expert and encoder-balance injection -> activation checkpointing -> compile -> FSDP. Expert injection swaps
parameters for EP-sharded DTensors and sets the MoE dispatchers, which checkpointing and
compile must then capture;
checkpointing and compile wrap the block's forward, and FSDP must see the final module tree
so its hooks sit outside both.

The pipeline cut is generic (``veomni/parallel/pipeline``) and imports no modality code: the
graph and media wings' rules and stage pieces reach it through ``PIPELINE_HOOKS``, which every
caller of its builders and checks passes.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from veomni.config.schema import ParallelConfig
from veomni.contract.hooks import attention_modules
from veomni.contract.media import MediaHost
from veomni.contract.plan import ParallelPlan, flatten_plan, match_modules
from veomni.parallel.activation_checkpoint import apply_activation_checkpointing
from veomni.parallel.context import apply_context_parallel
from veomni.parallel.cp_cost import auto_cp_mesh
from veomni.parallel.expert import apply_expert_parallel
from veomni.parallel.fsdp import apply_fsdp, mixed_precision_policy
from veomni.parallel.graph.aggregation import apply_block_sampling
from veomni.parallel.graph.halo import apply_graph_parallel
from veomni.parallel.graph.layer_pipeline import check_graph_stages
from veomni.parallel.media.colocate import apply_media_routing
from veomni.parallel.media.pipeline_encoders import PipelineMedia
from veomni.parallel.mesh import ParallelMeshes
from veomni.parallel.pipeline.layout import SPLIT_BACKWARD_SCHEDULES
from veomni.parallel.pipeline.stage_hooks import StageHooks
from veomni.parallel.sequence import apply_sequence_parallel, check_sequence_parallel, kv_repeat_factor

logger = logging.getLogger(__name__)

_MEDIA = PipelineMedia()
PIPELINE_HOOKS = StageHooks(checks=(check_graph_stages, _MEDIA.check), media=_MEDIA)
"""The graph and media wings, as the pipeline builders and checks take them (graph rules first:
a graph model's own schedules replace the generic ones)."""


@torch.no_grad()
def store_frozen(model: nn.Module, dtype: torch.dtype) -> int:
    """Every frozen floating-point parameter stored in ``dtype``; returns how many changed. FSDP2
    needs one dtype only among the parameters that train, so a bf16 frozen base beside fp32
    adapters shards as one unit."""
    count = 0
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
            count += 1
    return count


def apply_compile(model: nn.Module, plan: ParallelPlan) -> None:
    """Compile each block in place (``Module.compile`` keeps parameter names unchanged)."""
    blocks = match_modules(model, plan.blocks)
    for _, block in blocks:
        block.compile()
    logger.info("torch.compile on %d blocks", len(blocks))


def _auto_cp_mesh(model: nn.Module, plan: ParallelPlan, meshes: ParallelMeshes, device_type: str,
                  row_tokens: int) -> tuple[int, int]:
    if row_tokens <= 0:
        raise ValueError("parallel.cp_mesh is empty (automatic) but parallelize() got no row_tokens to size "
                         "the choice; pass row_tokens or set parallel.cp_mesh")
    dims = meshes.dims
    attention = attention_modules(model, plan.attention)[0][1].attention_spec()  # all of a model's alike
    kv_heads = attention.num_kv_heads * kv_repeat_factor(attention.num_heads, attention.num_kv_heads, dims.sp)
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    shape = auto_cp_mesh(meshes.cp.get_group(), device, row_tokens // dims.cp, attention.num_heads // dims.sp,
                         kv_heads // dims.sp, attention.head_dim, dtype, attention.causal)
    logger.info("parallel.cp_mesh chosen from the measured link and attention time: %s", list(shape))
    return shape


def parallelize(model: nn.Module, cfg: ParallelConfig, meshes: ParallelMeshes, device_type: str,
                row_tokens: int = 0, frozen_dtype: torch.dtype | None = None, graph_hops: int = 0) -> nn.Module:
    """``row_tokens`` (the micro-batch budget) sizes the automatic Mesh-Attention choice;
    ``frozen_dtype`` stores the parameters that do not train in that dtype (a LoRA run's base in
    bf16 on GPU), before anything shards them; ``graph_hops``: the hops of sampled graph
    mini-batches (``data.graph_fanouts``), 0 for full-graph training."""
    if frozen_dtype is not None:
        store_frozen(model, frozen_dtype)
    problems = check_sequence_parallel(model, meshes.dims.sp, meshes.dims.cp)  # the launcher's check, for callers
    if problems:
        raise ValueError("; ".join(problems))
    top = model.parallel_plan()  # the row's attention: encoders attend within their own items
    plan = flatten_plan(top)  # encoder blocks are treated like the LLM's
    if not match_modules(model, plan.blocks):
        raise ValueError(f"{type(model).__name__}.parallel_plan() blocks {plan.blocks} match no module")
    if meshes.dims.cp > 1:
        a, b = meshes.dims.cp_mesh or _auto_cp_mesh(model, top, meshes, device_type, row_tokens)
        count = apply_context_parallel(model, top, meshes.cp_groups(a, b))
        logger.info("context parallelism (cp=%d, %s) on %d attention modules", meshes.dims.cp,
                    "ring" if a == 1 else f"Mesh-Attention {a}x{b}", count)
    if meshes.dims.sp > 1:  # after cp: Ulysses wraps the context-parallel core (the hybrid)
        count = apply_sequence_parallel(model, top, meshes.sp.get_group())
        logger.info("Ulysses sequence parallelism (sp=%d) on %d attention modules", meshes.dims.sp, count)
    if plan.message_passing and graph_hops:  # each rank's own mini-batches: no exchange
        count = apply_block_sampling(model, plan, graph_hops)
        logger.info("sampled-block aggregation on %d message-passing modules", count)
    elif plan.message_passing:
        group = meshes.dp.get_group() if meshes.dims.dp_size > 1 else None
        count = apply_graph_parallel(model, plan, group)
        logger.info("graph aggregation on %d message-passing modules (%d partitions)", count, meshes.dims.dp_size)
    experts = apply_expert_parallel(model, plan, meshes.ep, meshes.loss, meshes.dims.loss_size)
    # (a pipeline that colocates its encoders routes their media around the schedule: media/pipeline_encoders.py)
    routed = cfg.encoder_balance or cfg.encoder_sp > 1 or (isinstance(model, MediaHost) and meshes.dims.sp > 1)
    if routed and not meshes.dims.pipeline_encoders:
        apply_media_routing(model, meshes, cfg)
    apply_activation_checkpointing(model, plan, cfg.activation_checkpointing)
    if cfg.compile:
        apply_compile(model, plan)
    reshard = cfg.reshard_after_forward
    if reshard and cfg.pp > 1 and cfg.pp_schedule in SPLIT_BACKWARD_SCHEDULES:
        logger.info("FSDP reshard_after_forward off: %s defers weight gradients past the backward pass",
                    cfg.pp_schedule)
        reshard = False
    offload = cfg.cpu_offload and device_type != "cpu"
    if cfg.cpu_offload and not offload:
        logger.info("parallel.cpu_offload ignored: the model already lives in CPU memory")
    return apply_fsdp(
        model,
        plan,
        meshes.fsdp,
        mixed_precision_policy(cfg.mixed_precision, device_type),
        reshard_after_forward=reshard,
        cpu_offload=offload,
        experts=experts,
        expert_mesh=meshes.ep_fsdp,
        encoders=tuple(model.parallel_plan().encoders),
        encoder_mesh=meshes.encoder_fsdp if meshes.dims.encoders_own_mesh else None,
    )
