"""Activation checkpointing of the plan's blocks: full recompute, or selective by op."""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from veomni.contract.plan import ParallelPlan, match_modules

logger = logging.getLogger(__name__)

_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
"""Selective mode keeps the outputs of these (the expensive ops) and recomputes the rest
(norms, activations, RoPE), trading a little compute for most of the activation memory."""


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def replace_module(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, child = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    parent.register_module(child, new)


def apply_activation_checkpointing(model: nn.Module, plan: ParallelPlan, mode: str) -> nn.Module:
    if mode == "none":
        return model
    if mode == "full":
        checkpoint_fn = functools.partial(checkpoint, use_reentrant=False)
    elif mode == "selective":
        context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
        checkpoint_fn = functools.partial(checkpoint, use_reentrant=False, context_fn=context_fn)
    else:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}")
    blocks = match_modules(model, plan.blocks)
    for path, block in blocks:
        replace_module(model, path, checkpoint_wrapper(block, checkpoint_fn=checkpoint_fn))
    logger.info("activation checkpointing (%s) on %d blocks", mode, len(blocks))
    return model
