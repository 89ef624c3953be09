"""Ulysses sequence parallelism, applied through the attention injection point.

Each rank of an SP group holds ``T / sp`` consecutive tokens of the packed row. Around every
attention core (the plan's ``attention`` modules) an all-to-all gathers the sequence and
scatters the heads: attention then runs over the whole row for ``H / sp`` heads, with the
global ``cu_seqlens``, so sample boundaries survive any split point; the inverse all-to-all
restores the token layout. Everything else in the model is per token and runs unchanged.

- What is sliced is the task's batch contract: its ``sequence_fields``, padded with its
  ``pad_values`` (labels: no target). Rows whose length does not divide by ``sp`` are padded at
  the end; padding lies past ``cu_seqlens[-1]`` (attention gives it zero output), has no label
  and is marked by the batch's ``valid_tokens`` (MoE layers do not route it), so it changes
  nothing.
- GQA: K/V heads are repeated just enough that their count divides ``sp`` and still divides
  the query heads, keeping each query head with its own K/V head.
- Positions: ``position_ids`` are sliced from the full row, so RoPE sees global positions.
- Loss: each rank counts the loss tokens of its own slice, so the trainer's global-token
  normalisation (reduced over dp x sp) needs no SP-specific term.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from veomni.ops.attention import AttentionFn, SeqInfo
from veomni.parallel.comm_counter import COMM_COUNTER
from veomni.parallel.plan import ParallelPlan, match_modules
from veomni.tasks.base import BatchContract


def shard_batch(batch: dict[str, Any], sp_rank: int, sp_size: int, contract: BatchContract) -> dict[str, Any]:
    """This rank's slice of each of the contract's sequence fields of a packed row (padded with
    the contract's pad values); every other field (``cu_seqlens``, ``max_seqlen``) stays
    global. ``valid_tokens`` counts the slice's leading real rows, so MoE layers leave the
    padding unrouted."""
    total = contract.row_length(batch)
    padded = math.ceil(total / sp_size) * sp_size
    local = padded // sp_size
    out = dict(batch)
    for key in contract.sequence_fields:
        value = batch[key]
        if value.shape[0] != total:
            raise ValueError(f"batch field {key!r} has {value.shape[0]} rows, the row has {total}: every "
                             "sequence field of the task's contract must run along the row")
        if padded > total:
            value = torch.cat([value, value.new_full((padded - total, *value.shape[1:]),
                                                     contract.pad_value(key))])
        out[key] = value[sp_rank * local:(sp_rank + 1) * local]
    out["valid_tokens"] = min(max(total - sp_rank * local, 0), local)
    return out


def kv_repeat_factor(num_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """Smallest factor f such that ``num_kv_heads * f`` divides by ``sp_size`` and divides ``num_heads``."""
    for factor in range(1, num_heads // num_kv_heads + 1):
        kv = num_kv_heads * factor
        if kv % sp_size == 0 and num_heads % kv == 0:
            return factor
    raise ValueError(f"no K/V head count fits sp={sp_size} with {num_heads} query / {num_kv_heads} K/V heads")


def check_sequence_parallel(model: nn.Module, sp_size: int) -> list[str]:
    """Problems that make ``sp_size`` impossible for this model (empty when it fits)."""
    if sp_size == 1:
        return []
    plan: ParallelPlan = model.parallel_plan()
    if plan.encoders:
        return [f"parallel.sp={sp_size}: sequence parallelism is not supported for models with encoders "
                f"({', '.join(plan.encoders)}): the encoder features spliced into a row would have to be "
                "scattered over the sequence-parallel ranks; use parallel.sp: 1"]
    if plan.message_passing:
        return [f"parallel.sp={sp_size}: a graph model has no sequence to split; graphs scale by partitions "
                "(each data-parallel rank trains one partition of the nodes) and by layers (parallel.pp, "
                "GNNPipe): set parallel.sp: 1 and those ranks become graph partitions"]
    modules = match_modules(model, plan.attention)
    if not modules:
        return [f"parallel.sp={sp_size}: the model's plan declares no attention modules to run sequence-parallel"]
    name, module = modules[0]  # all attention modules of a model share their head counts
    if module.num_heads % sp_size:
        return [f"parallel.sp={sp_size} does not divide the {module.num_heads} attention heads of {name}; "
                f"use a divisor of {module.num_heads}"]
    kv_repeat_factor(module.num_heads, module.num_kv_heads, sp_size)  # raises if no K/V layout fits
    return []


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    sp = dist.get_world_size(group)
    COMM_COUNTER.record("sp_all_to_all", x.numel() * x.element_size() * (sp - 1) // sp)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


class _Exchange(torch.autograd.Function):
    """All-to-all along dim 0 in equal chunks. It is its own adjoint: the gradient of the
    chunk a rank sent to rank j comes back from rank j by the same exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(grad, ctx.group), None


def _exchange(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Exchange.apply(x, group)


def gather_sequence_scatter_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[T/sp, H, D] on each rank -> [T, H/sp, D] (this rank's head chunk, all tokens)."""
    sp = dist.get_world_size(group)
    local_tokens, heads, dim = x.shape
    chunks = x.view(local_tokens, sp, heads // sp, dim).transpose(0, 1)  # [sp, T/sp, H/sp, D]
    return _exchange(chunks, group).view(sp * local_tokens, heads // sp, dim)


def gather_heads_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[T, H/sp, D] -> [T/sp, H, D]: the inverse of ``gather_sequence_scatter_heads``."""
    sp = dist.get_world_size(group)
    tokens, local_heads, dim = x.shape
    received = _exchange(x.view(sp, tokens // sp, local_heads, dim), group)  # [sp(head chunk), T/sp, H/sp, D]
    return received.transpose(0, 1).reshape(tokens // sp, sp * local_heads, dim)


class UlyssesAttention:
    """Wraps an attention core ``fn(q, k, v, seq)`` with the Ulysses all-to-alls."""

    def __init__(self, inner: AttentionFn, group: dist.ProcessGroup, kv_repeat: int) -> None:
        self.inner = inner
        self.group = group
        self.kv_repeat = kv_repeat

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SeqInfo) -> torch.Tensor:
        if self.kv_repeat > 1:
            k = k.repeat_interleave(self.kv_repeat, dim=1)
            v = v.repeat_interleave(self.kv_repeat, dim=1)
        q, k, v = (gather_sequence_scatter_heads(t, self.group) for t in (q, k, v))
        return gather_heads_scatter_sequence(self.inner(q, k, v, seq), self.group)


def apply_sequence_parallel(model: nn.Module, plan: ParallelPlan, group: dist.ProcessGroup) -> int:
    """Replace the ``attn_fn`` of every plan attention module; returns how many."""
    sp = dist.get_world_size(group)
    modules = match_modules(model, plan.attention)
    for _, module in modules:
        module.attn_fn = UlyssesAttention(module.attn_fn, group,
                                          kv_repeat_factor(module.num_heads, module.num_kv_heads, sp))
    return len(modules)


@contextmanager
def full_sequence_attention(model: nn.Module) -> Iterator[None]:
    """Run with the plain attention cores (every rank holding the whole sequence), e.g. for
    generation, where all ranks decode the same prompt."""
    wrapped = [(m, m.attn_fn) for m in model.modules() if isinstance(getattr(m, "attn_fn", None), UlyssesAttention)]
    for module, fn in wrapped:
        module.attn_fn = fn.inner
    try:
        yield
    finally:
        for module, fn in wrapped:
            module.attn_fn = fn
