"""Packed variable-length attention, causal (decoders) or bidirectional (encoders).

Tokens of several samples are packed into one row ``[T, H, D]``; ``SeqInfo.cu_seqlens`` holds
the sample boundaries. Attention is causal within a sample (``bidirectional_varlen_attention``:
full within a sample) and never crosses samples; tokens after ``cu_seqlens[-1]`` are padding
and get a zero output.

The kernel is picked per call: on CUDA in half precision, a real varlen kernel
(``torch.nn.attention.varlen.varlen_attn``, else ``flash_attn``); everywhere else an exact
SDPA fallback (see ``sdpa_varlen_attention``). ``cross_varlen_attention`` is the packed
cross-attention of a DiT's patch tokens to their own sample's text states.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

# The per-sample loop costs ~0.1-0.2 ms of overhead per sample (forward + backward); one masked
# SDPA call costs ~1e-10 s per T*T*Hq*D unit on CPU (it computes every cross-sample score too).
# The mask wins when T*T*Hq*D <= this constant * n_samples: measured on a 2-core CPU over
# n in [2, 512], T in [256, 4096], Hq*D in [64, 512] (see docs/llm.md).
BLOCK_DIAGONAL_WORK_PER_SAMPLE = 1.5e6


class RowShare(NamedTuple):
    """The rows ``[start, stop)`` of a packed sequence that this rank holds when one encoder input
    runs sequence-parallel over several ranks (``veomni/parallel/media/encoder_sp.py``), the other ranks
    holding the rest. ``handle`` belongs to the parallel recipe (its process group, the padded
    chunk size); a model passes it on untouched in its ``SeqInfo``."""

    start: int
    stop: int
    handle: object


class SeqInfo(NamedTuple):
    """Sample boundaries of a packed row: ``cu_seqlens`` int32 [n+1], longest sample length.

    ``share``: set when the caller holds only ``share.start:share.stop`` of the row (``q``/``k``/
    ``v`` have that many rows) while ``cu_seqlens`` and ``max_seqlen`` still describe the whole
    row; only an ``attn_fn`` installed by the recipe that made the share can attend then (it
    gathers the other rows)."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    share: RowShare | None = None


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, SeqInfo], torch.Tensor]
VarlenKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, SeqInfo, bool], torch.Tensor]


@functools.cache
def _cuda_varlen_kernel() -> VarlenKernel | None:
    """The first available CUDA varlen kernel ``(q, k, v, seq, causal)`` (flash attention needs
    sm80+), or None."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:
        return None
    if torch.backends.cuda.is_flash_attention_available():
        from torch.nn.attention.varlen import varlen_attn

        gqa = gqa_keywords(varlen_attn)

        def torch_varlen(q, k, v, seq, causal):
            cu, n = seq.cu_seqlens, seq.max_seqlen
            return varlen_attn(q, k, v, cu, cu, n, n, window_size=(-1, 0 if causal else -1), **gqa)

        return torch_varlen
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None

    def flash_varlen(q, k, v, seq, causal):
        cu, n = seq.cu_seqlens, seq.max_seqlen
        return flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=causal)

    return flash_varlen


def gqa_keywords(varlen_attn: Callable) -> dict[str, bool]:
    """What ``torch.nn.attention.varlen.varlen_attn`` needs to take fewer K/V heads than query
    heads: ``enable_gqa=True`` where it has that keyword (torch 2.13 has it); torch 2.11's has none and
    its flash kernel takes GQA as it is (checked on an H200: GQA 8:2 and MHA, causal and full,
    equal an fp32 reference)."""
    return {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SeqInfo, causal: bool = True
) -> torch.Tensor:
    """Attention within each packed sample: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D].

    GQA: ``Hq`` must be a multiple of ``Hkv``. This is the default ``attn_fn`` of decoder
    attention modules; parallel recipes wrap or replace it.
    """
    if seq.share is not None:
        raise ValueError(
            "attention got a row share (one encoder input split over ranks) but no attn_fn that gathers "
            "the other ranks' rows: install veomni.parallel.media.encoder_sp.apply_encoder_sp on the encoder "
            "before running it on shares"
        )
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        kernel = _cuda_varlen_kernel()
        if kernel is not None:
            # Varlen kernels leave padding rows uninitialised; zero them without a host sync.
            is_token = torch.arange(q.shape[0], device=q.device) < seq.cu_seqlens[-1]
            return torch.where(is_token[:, None, None], kernel(q, k, v, seq, causal), 0.0)
    return sdpa_varlen_attention(q, k, v, seq, causal=causal)


def bidirectional_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SeqInfo
) -> torch.Tensor:
    """Full (non-causal) attention within each packed sample, never across samples: the
    default ``attn_fn`` of encoder attention modules (one sample = one image or video frame)."""
    return varlen_attention(q, k, v, seq, causal=False)


def sdpa_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq: SeqInfo,
    block_diagonal: bool | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Exact fallback built on ``F.scaled_dot_product_attention``.

    Two strategies give the same result: one SDPA call per sample (no wasted compute, but a
    Python loop and a host sync), or one SDPA call over the whole row with a block-diagonal mask
    (one kernel, no host sync, so it compiles into the block's graph; but it computes the
    masked-out cross-sample scores). ``block_diagonal=None`` picks by the rule above from the
    shapes alone; tests force each path.
    """
    samples = seq.cu_seqlens.shape[0] - 1
    if block_diagonal is None:
        work = q.shape[0] * q.shape[0] * q.shape[1] * q.shape[2]
        block_diagonal = work <= BLOCK_DIAGONAL_WORK_PER_SAMPLE * samples
    if block_diagonal:
        return _block_diagonal(q, k, v, seq.cu_seqlens, causal)
    bounds = seq.cu_seqlens.tolist()
    out = torch.cat([_sdpa(q[a:b], k[a:b], v[a:b], causal) for a, b in itertools.pairwise(bounds)])
    if bounds[-1] < q.shape[0]:
        out = torch.cat([out, out.new_zeros(q.shape[0] - bounds[-1], *out.shape[1:])])
    return out


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """SDPA on one [L, H, D] segment; an explicit mask replaces ``causal``."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal and mask is None,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


def _block_diagonal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool
) -> torch.Tensor:
    """One SDPA call under a sample mask built on the device from ``cu_seqlens``: no host sync and
    no data-dependent shape, so a compiled block traces it as one graph. The padding rows form one
    more "sample" (they attend only among themselves, so no softmax row is empty) and are zeroed."""
    cu_seqlens = cu_seqlens.to(q.device)
    pos = torch.arange(q.shape[0], device=q.device)
    sample = torch.searchsorted(cu_seqlens[1:], pos, right=True)
    mask = sample[:, None] == sample[None, :]
    if causal:
        mask = mask & (pos[:, None] >= pos[None, :])
    out = _sdpa(q, k, v, causal, mask)
    return out * (pos < cu_seqlens[-1])[:, None, None].to(out.dtype)


def cross_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_sample_index: torch.Tensor,
    kv_cu_seqlens: torch.Tensor,
    per_sample: bool | None = None,
) -> torch.Tensor:
    """Cross-attention of packed queries to packed per-sample contexts (a DiT's text states).

    ``q`` [Tq, H, D] are tokens of several samples in any order (a sequence-parallel slice too),
    ``q_sample_index`` [Tq] their sample (-1: padding); ``k``/``v`` [S, H, D] hold every sample's
    context one after another, ``kv_cu_seqlens`` [n+1] their boundaries. Each query attends only
    to its own sample's context; a padding query, or one whose sample has an empty context, gets
    zeros (its gradient is zero too: no NaN from an empty softmax reaches the weights).

    Two exact strategies, as in ``sdpa_varlen_attention``: one SDPA call with a [Tq, S] sample
    mask (no host sync; computes the n - 1 other samples' scores too), or one call per contiguous
    run of equal sample ids (no waste; a host sync and a Python loop). ``per_sample=None`` picks
    the mask when ``Tq * S * H * D <= BLOCK_DIAGONAL_WORK_PER_SAMPLE * n``. A row with one
    non-empty caption (``n == 1``, known from the shape) needs neither: one SDPA call, no mask.
    """
    samples = kv_cu_seqlens.shape[0] - 1
    if samples == 1 and k.shape[0] > 0:
        return _cross_one_context(q, k, v, q_sample_index)
    if per_sample is None:
        per_sample = q.shape[0] * k.shape[0] * q.shape[1] * q.shape[2] > BLOCK_DIAGONAL_WORK_PER_SAMPLE * samples
    if per_sample:
        return _cross_per_run(q, k, v, q_sample_index, kv_cu_seqlens)
    kv_cu_seqlens = kv_cu_seqlens.to(q.device)
    positions = torch.arange(k.shape[0], device=q.device)
    kv_sample = torch.searchsorted(kv_cu_seqlens[1:], positions, right=True)
    context_lengths = torch.diff(kv_cu_seqlens)
    sample = q_sample_index.clamp(min=0)
    empty = (q_sample_index < 0) | (context_lengths[sample] == 0)
    mask = (sample[:, None] == kv_sample[None, :]) | empty[:, None]
    out = _sdpa(q, k, v, causal=False, mask=mask)
    return out * (~empty)[:, None, None].to(out.dtype)


def _cross_one_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_sample_index: torch.Tensor) -> torch.Tensor:
    """One caption for the whole row (a row of one video): every real query sees all of it, so
    SDPA runs without a mask (a flash kernel on a GPU) and nothing is read back to the host;
    padding queries are zeroed."""
    out = _sdpa(q, k, v, causal=False)
    return out * (q_sample_index >= 0)[:, None, None].to(out.dtype)


def _cross_per_run(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_sample_index: torch.Tensor, kv_cu_seqlens: torch.Tensor
) -> torch.Tensor:
    ids, counts = torch.unique_consecutive(q_sample_index, return_counts=True)
    bounds = kv_cu_seqlens.tolist()
    pieces, start = [q.new_zeros(0, q.shape[1], v.shape[2])], 0
    for sample, count in zip(ids.tolist(), counts.tolist()):
        rows = slice(start, start + count)
        start += count
        if sample < 0 or bounds[sample] == bounds[sample + 1]:
            pieces.append(q.new_zeros(count, q.shape[1], v.shape[2]))
            continue
        context = slice(bounds[sample], bounds[sample + 1])
        pieces.append(_sdpa(q[rows], k[context], v[context], causal=False))
    return torch.cat(pieces)
