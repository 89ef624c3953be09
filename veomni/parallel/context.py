"""Context parallelism: ring attention and Mesh-Attention over packed rows, on the attention
injection point.

Layout (``row_split.py``). Every sample of the row is cut into ``2 * cp`` pieces and cp rank
``r`` holds pieces ``r`` and ``2cp - 1 - r`` of each (per-sample zig-zag), so under a causal mask
every rank has the same work from every sample and none waits for the others. ``cu_seqlens``
stays global, so every rank knows every rank's pieces: a query chunk meets a key/value chunk
only where they hold pieces of the same sample, and nothing is computed for pairs no sample
spans.

Mesh-Attention (Seed, arXiv 2512.20968). The cp ranks form ``b`` rows of ``a`` consecutive ranks
(``a * b = cp``); rank ``r`` sits in row ``r // a`` and column ``r % a``. Rank ``r`` computes the
tile of the attention matrix made of its row's ``a`` query chunks against its column's ``b``
key/value chunks, and every (query chunk, key chunk) pair lies in exactly one tile, the diagonal
pair ``(r, r)`` in rank ``r``'s own. Per layer:

1. the ``a`` ranks of a row all-gather their query chunks;
2. key/value chunks travel around the column as a ring of ``b`` ranks (sends overlap compute);
3. each rank returns the partial outputs and LSEs of the row's other query chunks to their
   owners (one all-to-all), which merge them exactly.

Backward runs the same way: the row gathers the output gradients (with the outputs and LSEs the
block gradients need), the key/value chunks go around the column again with their dK/dV
accumulators, which arrive home after one more hop, and the row reduce-scatters dQ. ``a = 1`` is
ring attention; ``b = 1`` gathers all queries instead of all keys. Bytes sent per rank and layer
(``c`` = tokens per rank after any Ulysses exchange, ``e`` = bytes per element):

    forward:  (a-1) c H D e  [queries] + (b-1) 2 c Hkv D e  [K/V ring] + (a-1) c H (D e + 4)  [outputs, LSEs]
    backward: (a-1) c H (2 D e + 4)  [dout, out, LSE] + (b-1) 2 c Hkv D e + b 2 c Hkv D 4  [K/V, fp32 dK/dV]
              + (a-1) c H D 4  [fp32 dQ]

(``veomni/parallel/cp_cost.py`` holds the same formulas for the dry run.) Communication is counted
as ``cp_kv`` (along the column ring) and ``cp_q`` (within the row).

Hybrid: Ulysses (``sequence.py``) wraps this from outside: its all-to-all turns the ``sp`` ranks'
slices of one cp chunk into that whole chunk for ``H / sp`` heads, then the cp ranks exchange as
above. The loss needs no cp term: each rank counts the loss units of its own positions.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from veomni.contract.hooks import AttentionWrapper, attention_modules
from veomni.contract.plan import ParallelPlan
from veomni.ops.attention import AttentionFn, SeqInfo
from veomni.ops.attention_blocks import Segment, accumulators, attend_block, attend_block_backward, merge_partials
from veomni.parallel.comm_counter import COMM_COUNTER
from veomni.parallel.row_split import Piece, cp_pieces


class MeshGroups:
    """The process groups of a cp layout: ``row`` (size ``a``, consecutive cp ranks sharing query
    chunks; None when ``a = 1``) and ``column`` (size ``b``, the key/value ring; None when
    ``b = 1``), with this rank's cp coordinates."""

    def __init__(self, cp_rank: int, a: int, b: int, row: dist.ProcessGroup | None,
                 column: dist.ProcessGroup | None) -> None:
        self.cp_rank, self.a, self.b, self.row, self.column = cp_rank, a, b, row, column
        self.cp = a * b
        self.row_index, self.column_index = cp_rank // a, cp_rank % a
        if column is not None:
            position = dist.get_group_rank(column, dist.get_rank())
            self.next = dist.get_global_rank(column, (position + 1) % b)
            self.prev = dist.get_global_rank(column, (position - 1) % b)

    def row_members(self) -> list[int]:
        """cp ranks of this rank's row, in row order."""
        return [self.row_index * self.a + j for j in range(self.a)]

    def kv_owner(self, step: int) -> int:
        """cp rank whose key/value chunk this rank holds at ring step ``step``."""
        return self.column_index + self.a * ((self.row_index - step) % self.b)


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _shift(x: torch.Tensor, groups: MeshGroups) -> tuple[torch.Tensor, list[dist.Work]]:
    """Start sending ``x`` to the next rank of the column ring and receiving the previous one's."""
    received = torch.empty_like(x)
    COMM_COUNTER.record("cp_kv", _nbytes(x))
    ops = [dist.P2POp(dist.isend, x, groups.next, groups.column),
           dist.P2POp(dist.irecv, received, groups.prev, groups.column)]
    return received, dist.batch_isend_irecv(ops)


def _row_all_gather(x: torch.Tensor, groups: MeshGroups) -> torch.Tensor:
    """[a, *x.shape]: every row member's ``x``."""
    if groups.a == 1:
        return x.unsqueeze(0)
    COMM_COUNTER.record("cp_q", _nbytes(x) * (groups.a - 1))
    out = x.new_empty(groups.a * x.numel())
    dist.all_gather_single(out, x.contiguous().view(-1), group=groups.row)
    return out.view(groups.a, *x.shape)


def _row_all_to_all(x: torch.Tensor, groups: MeshGroups) -> torch.Tensor:
    """``x`` [a, ...]: entry j goes to row member j; returns what each member sent here."""
    if groups.a == 1:
        return x
    COMM_COUNTER.record("cp_q", _nbytes(x) * (groups.a - 1) // groups.a)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=groups.row)
    return out


def _row_reduce_scatter(x: torch.Tensor, groups: MeshGroups) -> torch.Tensor:
    """``x`` [a, ...]: the sum over row members of their entry for this rank."""
    if groups.a == 1:
        return x[0]
    COMM_COUNTER.record("cp_q", _nbytes(x) * (groups.a - 1) // groups.a)
    out = x.new_empty(x.shape[1:])
    dist.reduce_scatter_single(out.view(-1), x.contiguous().view(-1), group=groups.row)
    return out


class _ChunkPair:
    """One query chunk against one key/value chunk: at most two calls of the block kernel, one for
    the causal segments (a piece against itself) and one for the full ones (a piece against an
    earlier piece of its sample; any other piece of it when attention is bidirectional). Pieces of
    different samples never meet, and under a causal mask a piece never sees a later one."""

    def __init__(self, q_pieces: list[Piece], k_pieces: list[Piece], causal: bool) -> None:
        by_sample: dict[int, list[Piece]] = {}
        for piece in k_pieces:
            by_sample.setdefault(piece.sample, []).append(piece)
        diagonal, full = [], []
        for qp in q_pieces:
            if qp.sample < 0:  # padding attends to nothing
                continue
            rows = (qp.local, qp.local + qp.end - qp.start)
            keys = []
            for kp in by_sample.get(qp.sample, ()):
                if causal and kp.index == qp.index:
                    diagonal.append(Segment(*rows, kp.local, kp.local + kp.end - kp.start))
                elif not causal or kp.index < qp.index:
                    keys.append((kp.local, kp.local + kp.end - kp.start))
            # A rank's two pieces of a sample sit side by side in its chunk: one key run per query piece.
            if keys:
                full.append(Segment(*rows, keys[0][0], keys[-1][1]))
                if any(a[1] != b[0] for a, b in zip(keys, keys[1:])):
                    raise AssertionError(f"key pieces of sample {qp.sample} are not adjacent: {keys}")
        self.blocks = [(tuple(segments), is_causal) for segments, is_causal in ((diagonal, True), (full, False))
                       if segments]

    def forward(self, q, k, v, out, lse, scale):
        for segments, causal in self.blocks:
            attend_block(q, k, v, segments, causal, out, lse, scale)

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, scale):
        for segments, causal in self.blocks:
            attend_block_backward(dout, q, k, v, out, lse, segments, causal, dq, dk, dv, scale)


class _RowPlan:
    """Every cp rank's pieces of one row and the chunk pairs between them, built once per row:
    all attention layers of a step meet the same row."""

    def __init__(self, bounds: tuple[int, ...], padded: int, cp: int, causal: bool) -> None:
        self.pieces, self.causal = cp_pieces(list(bounds), padded, cp), causal
        self._pairs: dict[tuple[int, int], _ChunkPair] = {}

    def pair(self, q_owner: int, kv_owner: int) -> _ChunkPair:
        key = (q_owner, kv_owner)
        if key not in self._pairs:
            self._pairs[key] = _ChunkPair(self.pieces[q_owner], self.pieces[kv_owner], self.causal)
        return self._pairs[key]


@functools.lru_cache(maxsize=8)
def _row_plan(bounds: tuple[int, ...], padded: int, cp: int, causal: bool) -> _RowPlan:
    return _RowPlan(bounds, padded, cp, causal)


_last_bounds: list = [None, ()]  # (the cu_seqlens tensor last read, its values): one read per step, not per layer


def _row_bounds(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    if _last_bounds[0] is not cu_seqlens:
        _last_bounds[:] = [cu_seqlens, tuple(cu_seqlens.tolist())]
    return _last_bounds[1]


class _MeshAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _RowPlan,
                groups: MeshGroups) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5
        queries = _row_all_gather(q, groups)
        out, lse = accumulators(queries.flatten(0, 1), v)
        out, lse = out.view(queries.shape), lse.view(queries.shape[:3])
        kv = torch.stack([k, v])
        pairs = []
        for step in range(groups.b):
            pending = _shift(kv, groups) if step < groups.b - 1 else None
            for j, q_owner in enumerate(groups.row_members()):
                pair = plan.pair(q_owner, groups.kv_owner(step))
                pair.forward(queries[j], kv[0], kv[1], out[j], lse[j], scale)
                pairs.append(pair)
            if pending is not None:
                for work in pending[1]:
                    work.wait()
                kv = pending[0]
        partial_out = _row_all_to_all(out.to(q.dtype), groups).float()
        partial_lse = _row_all_to_all(lse, groups)
        final_out, final_lse = partial_out[0], partial_lse[0]
        for j in range(1, groups.a):
            final_out, final_lse = merge_partials(final_out, final_lse, partial_out[j], partial_lse[j])
        final_out = final_out.to(q.dtype)
        ctx.save_for_backward(queries, k, v, final_out, final_lse)
        ctx.pairs, ctx.groups, ctx.scale = pairs, groups, scale
        return final_out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        queries, k, v, out, lse = ctx.saved_tensors
        groups, scale = ctx.groups, ctx.scale
        douts = _row_all_gather(torch.stack([dout.contiguous(), out]), groups)  # [a, 2, c, H, D]
        lses = _row_all_gather(lse, groups)
        dq = torch.zeros(queries.shape, dtype=torch.float32, device=queries.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        pairs = iter(ctx.pairs)
        for step in range(groups.b):
            pending = _shift(kv, groups) if step < groups.b - 1 else None
            for j in range(groups.a):
                next(pairs).backward(douts[j, 0], queries[j], kv[0], kv[1], douts[j, 1], lses[j], dq[j],
                                     dkv[0], dkv[1], scale)
            if pending is not None:
                for work in pending[1]:
                    work.wait()
                kv = pending[0]
            if groups.b > 1:  # the accumulators follow their K/V chunk; the last hop takes them home
                dkv, works = _shift(dkv, groups)
                for work in works:
                    work.wait()
        dq = _row_reduce_scatter(dq, groups)
        return dq.to(queries.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


class ContextParallelAttention(AttentionWrapper):
    """Wraps an attention core ``fn(q, k, v, seq)``: ring attention (``a = 1``) or Mesh-Attention
    over this rank's zig-zag chunk of the row. ``inner`` is the wrapped core, used when every rank
    holds the whole sequence (``full_sequence_attention``)."""

    def __init__(self, inner: AttentionFn, groups: MeshGroups, causal: bool) -> None:
        self.inner, self.groups, self.causal = inner, groups, causal

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SeqInfo) -> torch.Tensor:
        plan = _row_plan(_row_bounds(seq.cu_seqlens), q.shape[0] * self.groups.cp, self.groups.cp, self.causal)
        if sum(p.end - p.start for p in plan.pieces[self.groups.cp_rank]) != q.shape[0]:
            raise ValueError(f"this rank holds {q.shape[0]} tokens, not its share of the row: rows must be split "
                             "with veomni.parallel.row_split.shard_batch")
        return _MeshAttention.apply(q, k, v, plan, self.groups)


def apply_context_parallel(model: nn.Module, plan: ParallelPlan, groups: MeshGroups) -> int:
    """Replace the ``attn_fn`` of every plan attention module; returns how many. Runs before
    Ulysses, which then wraps these from outside (the hybrid)."""
    modules = attention_modules(model, plan.attention)
    for _, module in modules:
        module.attn_fn = ContextParallelAttention(module.attn_fn, groups, module.attention_spec().causal)
    return len(modules)
