"""Attention over one block of a packed row, with its log-sum-exp: the unit context parallelism
computes, merges and differentiates.

A block is a query chunk against a key/value chunk, each a concatenation of pieces of samples
(``veomni/parallel/row_split.py``). Within it attention runs per ``Segment``: a run of query
rows of one sample against a run of key rows of the same sample, causal (a piece against
itself) or full (a piece against an earlier piece of its sample), and never across samples.

``attend_block`` returns each query row's output and log-sum-exp (``-inf`` for a row that sees
no key in the block); ``merge_partials`` combines partial results of several blocks exactly
(online softmax) and stays finite when a row has seen nothing yet. ``attend_block_backward``
takes the *final* output and LSE of the rows, so each block's gradients are exact parts of the
full gradient.

The kernel is chosen per call: flash attention's varlen kernel (one call per block) on CUDA in
half precision; torch's CPU flash kernel per segment on CPU; an exact matmul form elsewhere
(CUDA in fp32). All three return the same thing, checked in ``tests/test_attention_blocks.py``.
"""

from __future__ import annotations

import itertools
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


def _segment_rows(segments: list[Segment], device: torch.device) -> tuple[torch.Tensor, torch.Tensor,
                                                                          torch.Tensor, torch.Tensor, int, int]:
    """Row indices of the segments' queries and keys, their cumulative lengths, longest lengths."""
    q_rows = torch.cat([torch.arange(s.q_start, s.q_end) for s in segments])
    k_rows = torch.cat([torch.arange(s.k_start, s.k_end) for s in segments])
    q_lens = [s.q_end - s.q_start for s in segments]
    k_lens = [s.k_end - s.k_start for s in segments]
    cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *itertools.accumulate(k_lens)], dtype=torch.int32, device=device)
    return q_rows.to(device), k_rows.to(device), cu_q, cu_k, max(q_lens), max(k_lens)


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


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[Segment], causal: bool,
                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [Tq, H, D] (q's dtype) and LSE [Tq, H] (fp32) of the query piece against the key
    piece, per segment. GQA: ``H`` is a multiple of k/v's heads. Rows outside every segment get
    a zero output and LSE ``-inf``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32)
    if not segments:
        return out, lse
    groups = q.shape[1] // k.shape[1]
    if _use_flash_varlen(q):
        q_rows, k_rows, cu_q, cu_k, max_q, max_k = _segment_rows(segments, q.device)
        seg_out, seg_lse, *_ = torch.ops.aten._flash_attention_forward(
            q[q_rows], k[k_rows], v[k_rows], cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
        out[q_rows] = seg_out
        lse[q_rows] = seg_lse.transpose(0, 1).float() if seg_lse.shape[0] == q.shape[1] else seg_lse.float()
        return out, lse
    for s in segments:
        qs, ks, vs = q[s.q_start:s.q_end], _repeat_kv(k[s.k_start:s.k_end], groups), \
            _repeat_kv(v[s.k_start:s.k_end], groups)
        if q.device.type == "cpu":
            seg_out, seg_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                _bhld(qs), _bhld(ks), _bhld(vs), 0.0, causal, scale=scale)
            seg_out, seg_lse = _lhd(seg_out), seg_lse.squeeze(0).transpose(0, 1)
        else:
            seg_out, seg_lse = _math_forward(qs, ks, vs, causal, scale)
        out[s.q_start:s.q_end] = seg_out
        lse[s.q_start:s.q_end] = seg_lse.float()
    return out, lse


def attend_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, segments: list[Segment], causal: bool,
                          scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (fp32) of q, k, v from this block, given the rows' *final* output and LSE (of
    attention over every block) and the output gradient. Rows outside the segments get zeros."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    if not segments:
        return dq, dk, dv
    groups = q.shape[1] // k.shape[1]
    if _use_flash_varlen(q):
        q_rows, k_rows, cu_q, cu_k, max_q, max_k = _segment_rows(segments, q.device)
        seg_lse = lse[q_rows].transpose(0, 1).contiguous()
        empty = torch.empty(0, device=q.device)
        gq, gk, gv = torch.ops.aten._flash_attention_backward(
            dout[q_rows], q[q_rows], k[k_rows], v[k_rows], out[q_rows], seg_lse, cu_q, cu_k, max_q, max_k, 0.0,
            causal, empty, empty, scale=scale)
        dq[q_rows] = gq.float()
        dk.index_add_(0, k_rows, gk.float())
        dv.index_add_(0, k_rows, gv.float())
        return dq, dk, dv
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
    return dq, dk, dv


def merge_partials(out: torch.Tensor, lse: torch.Tensor, other_out: torch.Tensor,
                   other_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact combination of two partial attentions of the same rows over disjoint key sets:
    outputs [T, H, D] (fp32) weighted by their share of the joint softmax mass, LSEs [T, H]
    log-added. A row with ``-inf`` on both sides stays a zero output with LSE ``-inf``."""
    merged = torch.logaddexp(lse, other_lse)
    reference = torch.where(torch.isinf(merged), torch.zeros_like(merged), merged)
    weight, other_weight = torch.exp(lse - reference), torch.exp(other_lse - reference)
    return out * weight[..., None] + other_out * other_weight[..., None], merged
