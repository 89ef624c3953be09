"""MoE benchmark (a script, not a test): grouped expert compute against the naive loop over
experts, and expert-parallel all-to-all bytes per step against the analytic count.

    source scripts/_venv.sh && python scripts/bench_moe.py [--tokens 4096 --experts 32 ...]

1. Expert compute, forward + backward, tokens/s of three implementations of the same layer:
   - naive: the loop most reference code uses (HF Qwen3-MoE's eager path): for every expert,
     find its tokens in the whole batch, run them, scatter-add the result;
   - segments: sort rows by expert once, one matmul per non-empty expert (our CPU fallback);
   - grouped: sort once, ``torch.nn.functional.grouped_mm`` (our default where available).
2. EP traffic: a real gloo run (forked ranks) of one MoE layer forward + backward; counts the
   rows each rank sends to *other* ranks in the dispatch and combine all-to-alls, and
   compares with (a) the exact count from the routing and (b) the uniform-routing estimate
   ``4 * T * k * H * bytes * (ep - 1) / ep`` per rank (dispatch + combine, forward + backward).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.llm.config import LLMConfig
from models.llm.moe import MoE
from veomni.ops import grouped_gemm


def naive_experts(moe: MoE, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """HF-style eager loop: one pass over the whole batch per expert."""
    out = torch.zeros_like(x)
    for e in range(moe.num_experts):
        token, slot = torch.where(idx == e)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], moe.experts.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, moe.experts.down_proj[e]) * weights[token, slot, None]
        out.index_add_(0, token, y)
    return out


def _layer(args) -> MoE:
    cfg = LLMConfig(vocab_size=64, hidden_size=args.hidden, num_layers=1, num_heads=4, num_kv_heads=4,
                    head_dim=args.hidden // 4, num_experts=args.experts, num_experts_per_tok=args.top_k,
                    moe_intermediate_size=args.intermediate)
    moe = MoE(cfg, None)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return moe


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_compute(args) -> None:
    torch.manual_seed(0)
    moe = _layer(args)
    x = torch.randn(args.tokens, args.hidden, requires_grad=True)
    _, _, idx, weights = moe.router(x)
    idx, weights = idx.detach(), weights.detach()
    paths = {"naive": lambda: naive_experts(moe, x, idx, weights),
             "segments": lambda: _with_fused(False, lambda: moe.dispatcher(x, idx, weights, moe.experts)),
             "grouped": lambda: _with_fused(None, lambda: moe.dispatcher(x, idx, weights, moe.experts))}
    ref = paths["naive"]()
    for name in ("segments", "grouped"):
        torch.testing.assert_close(paths[name](), ref, atol=1e-5, rtol=1e-4)
    fused_ok = grouped_gemm.has_fused_grouped_mm()
    print(f"# expert compute, fwd+bwd: T={args.tokens} H={args.hidden} I={args.intermediate} "
          f"E={args.experts} k={args.top_k}, {torch.get_num_threads()} thread(s); fused grouped_mm "
          f"{'available' if fused_ok else 'NOT available (grouped = segments)'}")
    seconds = {name: _time(lambda f=fn: f().square().sum().backward(), args.repeats) for name, fn in paths.items()}
    for name, s in seconds.items():
        print(f"  {name:<9} {args.tokens / s:10.0f} tokens/s   x{seconds['naive'] / s:5.2f} vs naive")


def _with_fused(fused: bool | None, fn):
    """Run ``fn`` with the grouped_mm path the experts use forced (the benchmark's only knob)."""
    moe_module = sys.modules["models.llm.moe"]
    original = grouped_gemm.grouped_mm
    moe_module.grouped_mm = lambda x, w, c: original(x, w, c, fused=fused)
    try:
        return fn()
    finally:
        moe_module.grouped_mm = original


def _ep_traffic(rank: int, world: int, args) -> dict:
    import torch.distributed._functional_collectives as funcol

    from veomni.config.schema import ParallelConfig
    from veomni.contract.plan import ParallelPlan
    from veomni.parallel.expert import apply_expert_parallel
    from veomni.parallel.mesh import ParallelDims, build_mesh

    dims = ParallelDims.resolve(ParallelConfig(ep=world), world)
    meshes = build_mesh(dims, "cpu")
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.moe = _layer(args)
    apply_expert_parallel(holder, ParallelPlan(experts=("moe.experts",)), meshes.ep, meshes.dp, world)
    sent = {"rows_off_rank": 0, "bytes_off_rank": 0}
    original = funcol.all_to_all_single_autograd

    def counting(tensor, output_split_sizes, input_split_sizes, group):
        off = sum(n for r, n in enumerate(input_split_sizes) if r != rank)
        sent["rows_off_rank"] += off
        sent["bytes_off_rank"] += off * tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
        return original(tensor, output_split_sizes, input_split_sizes, group)

    funcol.all_to_all_single_autograd = counting
    torch.manual_seed(100 + rank)
    x = torch.randn(args.tokens, args.hidden, requires_grad=True)
    _, _, idx, _ = holder.moe.router(x)
    local = args.experts // world
    exact_rows = int(((idx // local) != rank).sum())
    holder.moe(x).square().sum().backward()
    funcol.all_to_all_single_autograd = original
    row_bytes = args.hidden * x.element_size()
    return {"measured_fwd": sent["bytes_off_rank"], "exact_dispatch": exact_rows * row_bytes,
            "uniform": 4 * args.tokens * args.top_k * row_bytes * (world - 1) / world}


def bench_ep(args) -> None:
    from harness.gloo_ranks import run_distributed

    results = run_distributed(_ep_traffic, args.ep, args)
    print(f"# EP all-to-all bytes sent off-rank, one MoE layer fwd+bwd, T={args.tokens} tokens per rank, "
          f"ep={args.ep}, H={args.hidden}, k={args.top_k}, fp32")
    # backward repeats both all-to-alls with the splits swapped: the same bytes again
    measured = [2 * r["measured_fwd"] for r in results]
    for rank, (m, r) in enumerate(zip(measured, results)):
        print(f"  rank {rank}: measured {m / 1e6:8.3f} MB   uniform-routing estimate {r['uniform'] / 1e6:8.3f} MB")
    # every off-rank dispatch row comes back in the combine: 4 transfers per routed row
    exact = 4 * sum(r["exact_dispatch"] for r in results)
    uniform = sum(r["uniform"] for r in results)
    print(f"  all ranks: measured {sum(measured) / 1e6:.3f} MB = exact from routing {exact / 1e6:.3f} MB "
          f"({sum(measured) / exact:.4f}); vs uniform estimate {uniform / 1e6:.3f} MB ({sum(measured) / uniform:.3f})")
    print("  per step: x MoE layers x micro-batches; the per-expert count exchange adds E * 8 bytes per layer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ep", type=int, default=2)
    args = parser.parse_args()
    bench_ep(args)  # first: the EP ranks are forked, before this process starts its thread pool
    bench_compute(args)


if __name__ == "__main__":
    main()
