"""What each way of splitting a row costs in communication, and the Mesh-Attention shape to pick.

Bytes each rank sends per attention layer, forward plus backward, for ``c`` tokens per rank
after any Ulysses exchange (``H``/``Hkv`` heads on those tokens, head size ``D``, ``e`` bytes per
element; gradient accumulators travel in fp32). The derivations are in ``context.py`` and
``sequence.py``; ``tests/parallel/test_context_parallel.py`` checks the counted bytes against them.

- Ulysses over ``sp`` ranks (``t`` tokens per rank, ``Hkv'`` K/V heads after repeating them to a
  multiple of ``sp``): ``2 * t * D * e * (2H + 2Hkv') * (sp-1)/sp``.
- Mesh-Attention ``a x b`` (``a = 1``: ring): ``cp_q`` = ``(a-1) * c * H * (4De + 4D + 8)`` and
  ``cp_kv`` = ``2 c Hkv D * ((b-1) 2e + b 4 [b > 1])``.

``choose_cp_mesh`` predicts one layer's attention time per shape: the row traffic cannot hide
behind compute, the ring's can (each hop overlaps a block), so
``time = q_bytes / bandwidth + max(compute, kv_bytes / bandwidth)``, and it takes the fastest.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def mesh_bytes(a: int, b: int, tokens: int, heads: int, kv_heads: int, head_dim: int,
               elem_bytes: int = 4) -> dict[str, int]:
    """Bytes one rank sends per layer (forward + backward), by counter kind."""
    # forward: queries, partial outputs and LSEs; backward: dout, outputs and LSEs, fp32 dQ
    q = (a - 1) * tokens * heads * (4 * head_dim * elem_bytes + 4 * head_dim + 8)
    kv_chunk = 2 * tokens * kv_heads * head_dim
    kv = (2 * (b - 1) * elem_bytes + (4 * b if b > 1 else 0)) * kv_chunk
    return {"cp_q": q, "cp_kv": kv}


def ulysses_bytes(tokens: int, heads: int, kv_heads: int, head_dim: int, sp: int, elem_bytes: int = 4) -> int:
    """Bytes one rank sends per layer (forward + backward) in Ulysses' all-to-alls; ``kv_heads``
    after repeating them to fit ``sp`` (``sequence.kv_repeat_factor``)."""
    return 2 * tokens * head_dim * elem_bytes * (2 * heads + 2 * kv_heads) * (sp - 1) // sp


def mesh_shapes(cp: int) -> list[tuple[int, int]]:
    return [(a, cp // a) for a in range(1, cp + 1) if cp % a == 0]


def predicted_seconds(a: int, b: int, tokens: int, heads: int, kv_heads: int, head_dim: int, elem_bytes: int,
                      bandwidth: float, compute_seconds: float) -> float:
    sent = mesh_bytes(a, b, tokens, heads, kv_heads, head_dim, elem_bytes)
    return sent["cp_q"] / bandwidth + max(compute_seconds, sent["cp_kv"] / bandwidth)


def choose_cp_mesh(cp: int, tokens: int, heads: int, kv_heads: int, head_dim: int, elem_bytes: int,
                   bandwidth: float, compute_seconds: float) -> tuple[int, int]:
    """The ``(a, b)`` with the least predicted attention time per layer (ring on a tie)."""
    return min(mesh_shapes(cp), key=lambda ab: (predicted_seconds(*ab, tokens, heads, kv_heads, head_dim, elem_bytes,
                                                                  bandwidth, compute_seconds), ab[0]))


def measure_link(group: dist.ProcessGroup, device: torch.device, megabytes: int = 4) -> float:
    """Bytes per second one rank moves in an all-gather over ``group`` (the slowest rank's
    figure, so every rank gets the same number and picks the same shape)."""
    size = dist.get_world_size(group)
    x = torch.zeros(megabytes * 2**18, device=device)
    out = x.new_empty(size * x.numel())
    dist.all_gather_single(out, x, group=group)  # warm-up: connection set-up is not bandwidth
    start = time.perf_counter()
    dist.all_gather_single(out, x, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return x.numel() * x.element_size() * (size - 1) / float(elapsed)


def _block_seconds(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device, causal: bool) -> float:
    """Forward + backward time of one ``tokens x tokens`` attention block on this device."""
    from veomni.ops.attention_blocks import Segment, accumulators, attend_block, attend_block_backward

    q = torch.randn(tokens, heads, head_dim, dtype=dtype, device=device)
    k, v = (torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2))
    segments = (Segment(0, tokens, 0, tokens),)
    start = time.perf_counter()
    out, lse = accumulators(q, v)
    attend_block(q, k, v, segments, causal, out, lse)
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=device) for t in (q, k, v)]
    attend_block_backward(out.to(dtype), q, k, v, out.to(dtype), lse, segments, causal, *grads)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def auto_cp_mesh(group: dist.ProcessGroup, device: torch.device, tokens: int, heads: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, causal: bool) -> tuple[int, int]:
    """Measure the cp group's link and one block's compute, then ``choose_cp_mesh``. ``tokens``
    per cp rank; the compute assumes one sample fills the row (the most attention work, the most
    time to hide the ring behind), a rank's tile being ``cp`` blocks of ``tokens x tokens``."""
    cp = dist.get_world_size(group)
    bandwidth = measure_link(group, device)
    elapsed = torch.tensor([_block_seconds(tokens, heads, kv_heads, head_dim, dtype, device, causal)],
                           dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return choose_cp_mesh(cp, tokens, heads, kv_heads, head_dim, torch.finfo(dtype).bits // 8, bandwidth,
                          cp * float(elapsed))
