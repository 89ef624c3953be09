"""Compute cost of context parallelism's block decomposition, on one device, without communication.

Each cp rank computes its tile of the attention matrix as (query piece, key piece) blocks
(``veomni/parallel/context.py``). This times every rank's tile in turn, forward + backward, on one
device and compares the slowest rank with an even share of the same row's attention run as one
call of the same kernel over the whole row (the cp = 1 baseline, timed in the same job):

    python scripts/bench_cp_blocks.py --tokens 131072 --cp 8           # GPU: bf16, flash varlen
    python scripts/bench_cp_blocks.py --tokens 16384 --cp 4 --heads 4 --kv-heads 2 --head-dim 32   # CPU

``slowest / share`` above 1 is the price of cutting attention into blocks (kernel launches, the
per-block LSE merge, a rank drawing more work than another); ``max / mean`` over ranks is the
load imbalance the zig-zag layout is there to remove: ``pairs`` counts the (query, key) pairs
each rank computes, ``time`` what they cost.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from veomni.ops.attention_blocks import Segment, accumulators, attend_block, attend_block_backward  # noqa: E402
from veomni.parallel.context import MeshGroups, _ChunkPair  # noqa: E402
from veomni.parallel.row_split import cp_pieces  # noqa: E402


def packed_bounds(tokens: int, mean_doc: int, seed: int) -> list[int]:
    """Sample boundaries of a row of documents with log-normal lengths (a long tail, as in text)."""
    gen = torch.Generator().manual_seed(seed)
    bounds = [0]
    while bounds[-1] < tokens:
        length = int(torch.empty(1).log_normal_(mean=0.0, std=1.0, generator=gen).item() * mean_doc / 1.65) + 1
        bounds.append(min(tokens, bounds[-1] + length))
    return bounds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn, device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / repeats


def rank_tile(cp_rank: int, a: int, b: int, bounds: list[int], q, k, v, repeats: int) -> tuple[float, int]:
    """One rank's tile, forward + backward, its query and key chunks cut from the whole row: the
    seconds it takes and the (query, key) pairs it computes."""
    groups = MeshGroups(cp_rank, a, b, None, None)
    pieces = cp_pieces(bounds, q.shape[0], a * b)
    scale = q.shape[-1] ** -0.5
    pairs = []
    for step in range(b):
        for q_owner in groups.row_members():
            kv_owner = groups.kv_owner(step)
            pairs.append((q_owner, _ChunkPair(pieces[q_owner], pieces[kv_owner], causal=True), kv_owner))

    def chunk_of(x, owner):
        return torch.cat([x[p.start:p.end] for p in pieces[owner]])

    chunks = {owner: (chunk_of(q, owner), chunk_of(k, owner), chunk_of(v, owner))
              for owner in {o for pair in pairs for o in (pair[0], pair[2])}}  # cut once: ranks hold them

    def step():  # as _MeshAttention does it: accumulators per query chunk, gradients per chunk
        acc = {owner: accumulators(chunks[owner][0], v) for owner in groups.row_members()}
        for q_owner, pair, kv_owner in pairs:
            pair.forward(chunks[q_owner][0], *chunks[kv_owner][1:], *acc[q_owner], scale)
        grads = {owner: [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in chunk]
                 for owner, chunk in chunks.items()}
        for q_owner, pair, kv_owner in pairs:
            out, lse = acc[q_owner]
            pair.backward(out.to(q.dtype), chunks[q_owner][0], *chunks[kv_owner][1:], out.to(q.dtype), lse,
                          grads[q_owner][0], *grads[kv_owner][1:], scale)

    work = sum((s.q_end - s.q_start) * (s.q_end - s.q_start + 1) // 2 if causal else
               (s.q_end - s.q_start) * (s.k_end - s.k_start)
               for _, pair, _ in pairs for segments, causal in pair.blocks for s in segments)
    return time_it(step, q.device, repeats), work


def row_zigzag_imbalance(bounds: list[int], cp: int) -> float:
    """Busiest rank's causal (query, key) pairs over the mean if the whole row were cut into
    2 cp pieces and rank r took pieces r and 2cp-1-r (what per-sample zig-zag replaces)."""
    lengths = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])])
    start = torch.repeat_interleave(torch.tensor(bounds[:-1]), lengths)
    depth = torch.arange(bounds[-1]) - start + 1  # keys each query sees
    pieces = depth.view(2 * cp, -1).sum(1)
    work = pieces[:cp] + pieces.flip(0)[:cp]
    return float(work.max() / work.float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--mean-doc", type=int, default=8192, help="mean document length in the packed row")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = args.tokens - args.tokens % (2 * args.cp)
    bounds = packed_bounds(tokens, args.mean_doc, seed=0)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, args.heads, args.head_dim, generator=gen).to(device, dtype)
    k, v = (torch.randn(tokens, args.kv_heads, args.head_dim, generator=gen).to(device, dtype) for _ in range(2))

    segments = tuple(Segment(a, b, a, b) for a, b in zip(bounds, bounds[1:]))

    def whole():
        out, lse = accumulators(q, v)
        attend_block(q, k, v, segments, True, out, lse)
        grads = [torch.zeros(t.shape, dtype=torch.float32, device=device) for t in (q, k, v)]
        attend_block_backward(out.to(dtype), q, k, v, out.to(dtype), lse, segments, True, *grads)

    baseline = time_it(whole, device, args.repeats)
    pairs = sum((e - s) * (e - s + 1) // 2 for s, e in zip(bounds, bounds[1:]))
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}  dtype {dtype}  "
          f"tokens {tokens}  documents {len(bounds) - 1}  heads {args.heads}/{args.kv_heads}x{args.head_dim}")
    print(f"cp=1 (the whole row in one varlen call), forward+backward: {baseline * 1e3:.1f} ms  "
          f"({3.5 * 4 * pairs * args.heads * args.head_dim / baseline / 1e12:.1f} TFLOP/s causal, bwd = 2.5x fwd)")
    whole_row = row_zigzag_imbalance(bounds, args.cp)
    print(f"zig-zag over the whole row instead of per sample: pairs max/mean {whole_row:.2f}")
    print(f"{'shape':>10} {'slowest rank ms':>16} {'share ms':>9} {'slowest/share':>14} {'time max/mean':>14} "
          f"{'pairs max/mean':>15}")
    for a in (d for d in range(1, args.cp + 1) if args.cp % d == 0):
        b = args.cp // a
        seconds, work = zip(*(rank_tile(r, a, b, bounds, q, k, v, args.repeats) for r in range(args.cp)))
        share = baseline / args.cp
        name = "ring" if a == 1 else f"{a}x{b}"
        print(f"{name:>10} {max(seconds) * 1e3:16.1f} {share * 1e3:9.1f} {max(seconds) / share:14.2f} "
              f"{max(seconds) / (sum(seconds) / len(seconds)):14.2f} {max(work) / (sum(work) / len(work)):15.2f}")


if __name__ == "__main__":
    main()
