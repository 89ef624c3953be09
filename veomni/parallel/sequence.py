"""Ulysses sequence parallelism, applied through the attention injection point.

Each rank of an SP group holds ``T / sp`` consecutive tokens of the packed row (of its
context-parallel chunk under the hybrid; ``row_split.py`` says which). Around every attention
core (the plan's ``attention`` modules) an all-to-all gathers the sequence and scatters the
heads: attention then runs over the whole row (chunk) for ``H / sp`` heads, with the global
``cu_seqlens``, so sample boundaries survive any split point; the inverse all-to-all restores
the token layout. Everything else in the model is per token and runs unchanged.

- Padding: rows are padded at the end (``row_split.py``); padding lies past ``cu_seqlens[-1]``
  (attention gives it zero output), has no label and is marked by the batch's
  ``valid_tokens`` (MoE layers do not route it), so it changes nothing.
- GQA: K/V heads are repeated just enough that their count divides ``sp`` and still divides
  the query heads, keeping each query head with its own K/V head.
- Positions: ``position_ids`` are sliced from the full row, so RoPE sees global positions.
- Media (omni models): each rank's slice holds the placeholders of some encoder features; the
  ranks of a row share the encoding of its items and each receives its slice's features
  (``colocate.py``, ``RoutedMediaFn``), written at local positions by the model's splice.
- Loss: each rank counts the loss tokens of its own slice, so the trainer's global-token
  normalisation (reduced over dp x sp) needs no SP-specific term.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from veomni.contract.hooks import AttentionModule, AttentionWrapper, attention_modules
from veomni.contract.media import MediaHost
from veomni.contract.plan import ParallelPlan
from veomni.ops.attention import AttentionFn, SeqInfo
from veomni.parallel.comm_counter import COMM_COUNTER


def kv_repeat_factor(num_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """Smallest factor f such that ``num_kv_heads * f`` divides by ``sp_size`` and divides ``num_heads``."""
    for factor in range(1, num_heads // num_kv_heads + 1):
        kv = num_kv_heads * factor
        if kv % sp_size == 0 and num_heads % kv == 0:
            return factor
    raise ValueError(f"no K/V head count fits sp={sp_size} with {num_heads} query / {num_kv_heads} K/V heads")


def check_sequence_parallel(model: nn.Module, sp_size: int, cp_size: int = 1) -> list[str]:
    """Problems that make Ulysses over ``sp_size`` ranks and context parallelism over ``cp_size``
    ranks impossible for this model (empty when they fit)."""
    if sp_size == 1 and cp_size == 1:
        return []
    keys = " x ".join(f"parallel.{k}={v}" for k, v in (("sp", sp_size), ("cp", cp_size)) if v > 1)
    plan: ParallelPlan = model.parallel_plan()
    if plan.encoders and cp_size > 1:
        return [f"{keys}: context parallelism is not supported for models with encoders "
                f"({', '.join(plan.encoders)}) yet: their features would have to reach each rank's zig-zag "
                "pieces of the row; use parallel.cp: 1 (parallel.sp > 1 works: features go to each slice)"]
    if plan.encoders and not isinstance(model, MediaHost):
        return [f"{keys}: {type(model).__name__} declares encoders ({', '.join(plan.encoders)}) but is no "
                "MediaHost, so their features cannot be routed to the ranks holding each sequence slice; "
                "run its encoders through MediaHost.media_fn or use parallel.sp: 1"]
    if plan.message_passing:
        return [f"{keys}: a graph model has no sequence to split; graphs scale by partitions "
                "(each data-parallel rank trains one partition of the nodes) and by layers (parallel.pp, "
                "GNNPipe): set parallel.sp and parallel.cp to 1 and those ranks become graph partitions"]
    try:
        modules = attention_modules(model, plan.attention)
    except TypeError as error:  # a module that does not declare its heads and mask
        return [f"{keys}: {error}"]
    if not modules:
        return [f"{keys}: the model's plan declares no attention modules to split the sequence around"]
    name, module = modules[0]  # all attention modules of a model share their head counts
    heads = module.attention_spec()
    if heads.num_heads % sp_size:
        divisors = [d for d in range(1, heads.num_heads + 1) if heads.num_heads % d == 0]
        return [f"parallel.sp={sp_size} does not divide the {heads.num_heads} attention heads of {name}; "
                f"use a divisor of {heads.num_heads} ({', '.join(map(str, divisors))}) and put the other "
                "ranks in parallel.cp (ring / Mesh-Attention has no head limit)"]
    kv_repeat_factor(heads.num_heads, heads.num_kv_heads, sp_size)  # raises if no K/V layout fits
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


class UlyssesAttention(AttentionWrapper):
    """Wraps an attention core ``fn(q, k, v, seq)`` (the model's, or context parallelism's) with
    the Ulysses all-to-alls."""

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
    modules = attention_modules(model, plan.attention)
    for _, module in modules:
        heads = module.attention_spec()
        repeat = kv_repeat_factor(heads.num_heads, heads.num_kv_heads, sp)
        module.attn_fn = UlyssesAttention(module.attn_fn, group, repeat)
    return len(modules)


@contextmanager
def full_sequence_attention(model: nn.Module) -> Iterator[None]:
    """Run with the plain attention cores (every rank holding the whole sequence), e.g. for
    generation, where all ranks decode the same prompt."""
    wrapped = [(m, m.attn_fn) for m in model.modules()
               if isinstance(m, AttentionModule) and isinstance(m.attn_fn, AttentionWrapper)]
    for module, fn in wrapped:
        inner = fn
        while isinstance(inner, AttentionWrapper):  # Ulysses around context parallelism around the model's core
            inner = inner.inner
        module.attn_fn = inner
    try:
        yield
    finally:
        for module, fn in wrapped:
            module.attn_fn = fn
