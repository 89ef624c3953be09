"""Attention over one block of a packed row, with its log-sum-exp: the unit context parallelism
computes, merges and differentiates.

A block is a query chunk against a key/value chunk, each a concatenation of pieces of samples
(``veomni/parallel/row_split.py``). Within it attention runs per ``Segment``: a run of query
rows of one sample against a run of key rows of the same sample, causal (a piece against
itself) or full (a piece against an earlier piece of its sample), and never across samples.

``attend_block`` merges a block's output and log-sum-exp into a query chunk's accumulators
(``merge_partials``: the exact online-softmax combination, finite for a row that has seen no
key yet), touching only the rows its segments hold. ``attend_block_backward`` takes the *final*
output and LSE of the rows, so each block's gradients are exact parts of the full gradient, and
adds them to the chunk's fp32 gradients.

The kernel is chosen per call: flash attention's varlen kernel (one call per block) on CUDA in
half precision; torch's CPU flash kernel per segment on CPU; an exact matmul form elsewhere
(CUDA in fp32). All three return the same thing, checked in ``tests/parallel/test_context_parallel.py``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch


class Segment(NamedTuple):
    """Rows ``[q_start, q_end)`` of the query chunk attend to rows ``[k_start, k_end)`` of the
    key/value chunk: one sample's part of the block."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _fold_kv(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum the gradients of repeated K/V heads back onto their shared head."""
    if groups == 1:
        return grad
    tokens, heads, dim = grad.shape
    return grad.view(tokens, heads // groups, groups, dim).sum(2)


def _bhld(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)


def _lhd(x: torch.Tensor) -> torch.Tensor:
    return x.squeeze(0).transpose(0, 1)


def _use_flash_varlen(q: torch.Tensor) -> bool:
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and torch.backends.cuda.is_flash_attention_available())


class BlockRows(NamedTuple):
    """What the varlen kernel takes for a block: the segments' query and key rows (a ``slice``
    when they are one run, which costs no gather), cumulative lengths (int32) and longest lengths."""

    q: slice | torch.Tensor
    k: slice | torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


@functools.lru_cache(maxsize=512)
def block_rows(segments: tuple[Segment, ...], device: torch.device) -> BlockRows:
    """Built once per block and device: every layer of a step meets the same blocks."""
    bounds = torch.tensor(segments, dtype=torch.int64).view(-1, 4)
    q_lens, k_lens = bounds[:, 1] - bounds[:, 0], bounds[:, 3] - bounds[:, 2]

    def rows(starts: torch.Tensor, lengths: torch.Tensor) -> slice | torch.Tensor:
        offsets = torch.cumsum(lengths, 0) - lengths  # where each segment begins in the gathered rows
        index = torch.arange(int(lengths.sum())) + torch.repeat_interleave(starts - offsets, lengths)
        first = int(index[0])
        if torch.equal(index, torch.arange(first, first + index.shape[0])):
            return slice(first, first + index.shape[0])
        return index.to(device)

    def cumulative(lengths: torch.Tensor) -> torch.Tensor:
        return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(device, torch.int32)

    return BlockRows(rows(bounds[:, 0], q_lens), rows(bounds[:, 2], k_lens), cumulative(q_lens), cumulative(k_lens),
                     int(q_lens.max()), int(k_lens.max()))


def _math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores[0], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]), v.float())
    return out.to(q.dtype), lse.transpose(0, 1)


def _math_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    qf, kf, vf, df = q.float(), k.float(), v.float(), dout.float()
    scores = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores[0], dtype=torch.bool).triu(1), float("-inf"))
    probs = torch.exp(scores - lse.transpose(0, 1)[..., None].float())
    delta = (df * out.float()).sum(-1).transpose(0, 1)  # [H, q]
    dv = torch.einsum("hqk,qhd->khd", probs, df)
    dscores = probs * (torch.einsum("qhd,khd->hqk", df, vf) - delta[..., None])
    dq = torch.einsum("hqk,khd->qhd", dscores, kf) * scale
    dk = torch.einsum("hqk,qhd->khd", dscores, qf) * scale
    return dq, dk, dv


def accumulators(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty output and LSE accumulators for the query rows ``q`` (fp32 zeros and ``-inf``)."""
    return (torch.zeros(*q.shape[:2], v.shape[2], dtype=torch.float32, device=q.device),
            torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device))


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: tuple[Segment, ...], causal: bool,
                 out: torch.Tensor, lse: torch.Tensor, scale: float | None = None) -> None:
    """Merge the block's attention into the accumulators ``out`` [Tq, H, D] and ``lse`` [Tq, H]
    (fp32; start from zeros and ``-inf``), per segment, touching only the segments' rows. GQA:
    ``H`` is a multiple of k/v's heads."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if not segments:
        return
    if _use_flash_varlen(q):
        rows = block_rows(tuple(segments), q.device)
        seg_out, seg_lse, *_ = torch.ops.aten._flash_attention_forward(
            q[rows.q], k[rows.k], v[rows.k], rows.cu_q, rows.cu_k, rows.max_q, rows.max_k, 0.0, causal, False,
            scale=scale)
        seg_lse = seg_lse.transpose(0, 1) if seg_lse.shape[0] == q.shape[1] else seg_lse
        out[rows.q], lse[rows.q] = merge_partials(out[rows.q], lse[rows.q], seg_out.float(), seg_lse.float())
        return
    groups = q.shape[1] // k.shape[1]
    for s in segments:
        rows, keys = slice(s.q_start, s.q_end), slice(s.k_start, s.k_end)
        qs, ks, vs = q[rows], _repeat_kv(k[keys], groups), _repeat_kv(v[keys], groups)
        if q.device.type == "cpu":
            seg_out, seg_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                _bhld(qs), _bhld(ks), _bhld(vs), 0.0, causal, scale=scale)
            seg_out, seg_lse = _lhd(seg_out), seg_lse.squeeze(0).transpose(0, 1)
        else:
            seg_out, seg_lse = _math_forward(qs, ks, vs, causal, scale)
        out[rows], lse[rows] = merge_partials(out[rows], lse[rows], seg_out.float(), seg_lse.float())


def attend_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, segments: tuple[Segment, ...], causal: bool,
                          dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, scale: float | None = None) -> None:
    """Add this block's gradients of q, k, v to ``dq``, ``dk``, ``dv`` (fp32), given the rows'
    *final* output and LSE (of attention over every block) and the output gradient."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if not segments:
        return
    if _use_flash_varlen(q):
        rows = block_rows(tuple(segments), q.device)
        empty = torch.empty(0, device=q.device)
        gq, gk, gv = torch.ops.aten._flash_attention_backward(
            dout[rows.q], q[rows.q], k[rows.k], v[rows.k], out[rows.q], lse[rows.q].transpose(0, 1).contiguous(),
            rows.cu_q, rows.cu_k, rows.max_q, rows.max_k, 0.0, causal, empty, empty, scale=scale)
        dq[rows.q] += gq.float()  # a block's query rows are distinct; its key rows may repeat
        if isinstance(rows.k, slice):
            dk[rows.k] += gk.float()
            dv[rows.k] += gv.float()
        else:
            dk.index_add_(0, rows.k, gk.float())
            dv.index_add_(0, rows.k, gv.float())
        return
    groups = q.shape[1] // k.shape[1]
    for s in segments:
        rows, keys = slice(s.q_start, s.q_end), slice(s.k_start, s.k_end)
        ks, vs = _repeat_kv(k[keys], groups), _repeat_kv(v[keys], groups)
        if q.device.type == "cpu":
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _bhld(dout[rows]), _bhld(q[rows]), _bhld(ks), _bhld(vs), _bhld(out[rows]),
                lse[rows].transpose(0, 1).unsqueeze(0).to(q.dtype), 0.0, causal, scale=scale)
            gq, gk, gv = _lhd(gq), _lhd(gk), _lhd(gv)
        else:
            gq, gk, gv = _math_backward(dout[rows], q[rows], ks, vs, out[rows], lse[rows], causal, scale)
        dq[rows] += gq.float()
        dk[keys] += _fold_kv(gk.float(), groups)
        dv[keys] += _fold_kv(gv.float(), groups)


def merge_partials(out: torch.Tensor, lse: torch.Tensor, other_out: torch.Tensor,
                   other_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact combination of two partial attentions of the same rows over disjoint key sets:
    outputs [T, H, D] (fp32) weighted by their share of the joint softmax mass, LSEs [T, H]
    log-added. A row with ``-inf`` on both sides stays a zero output with LSE ``-inf``."""
    merged = torch.logaddexp(lse, other_lse)
    reference = torch.where(torch.isinf(merged), torch.zeros_like(merged), merged)
    weight, other_weight = torch.exp(lse - reference), torch.exp(other_lse - reference)
    return out * weight[..., None] + other_out * other_weight[..., None], merged
