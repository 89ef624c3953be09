"""Ulysses, ring attention, Mesh-Attention and the hybrid at equal ranks on this machine.

    python scripts/bench_context_parallel.py [--ranks 4] [--tokens 8192] [--sample 3000]

For N ranks (N CPU processes, one thread each, gloo) and one packed row of T tokens (samples of
``--sample`` tokens, so they straddle the chunk boundaries), it runs forward+backward of the
context-parallel recipe's model (``recipes/long-context/tiny_32k_cp.yaml``; ``--heads`` /
``--kv-heads`` change its attention) under each way to split the row over N ranks: Ulysses
``sp=N`` (if the heads fit; it is the baseline), ring ``cp=N``, every Mesh-Attention shape
``a x b`` with ``1 < a < N``, and Ulysses 2 x ring ``N/2``. It prints the median step time,
its ratio to Ulysses from the same job, and the attention bytes each rank sent in one step
(``COMM_COUNTER``: ``sp_all_to_all`` + ``cp_q`` + ``cp_kv``) next to the formula of
``veomni/planner/sequence_split.py``. Run it on a quiet machine: the ratios are the point.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import models  # noqa: E402,F401  (registers the zoo)
from veomni.config.load import load_config  # noqa: E402
from veomni.config.schema import ParallelConfig  # noqa: E402
from veomni.contract import build_model  # noqa: E402
from veomni.data.packing import pack_samples  # noqa: E402
from veomni.parallel.apply import parallelize  # noqa: E402
from veomni.parallel.comm_counter import COMM_COUNTER  # noqa: E402
from veomni.parallel.cp_cost import mesh_shapes  # noqa: E402
from veomni.parallel.mesh import ParallelDims, build_mesh  # noqa: E402
from veomni.parallel.row_split import shard_batch  # noqa: E402
from veomni.planner.sequence_split import AttentionShape, split_cost, split_layouts  # noqa: E402
from veomni.tasks import LM_CONTRACT  # noqa: E402

RECIPE = REPO / "recipes" / "long-context" / "tiny_32k_cp.yaml"
KINDS = ("sp_all_to_all", "cp_q", "cp_kv")


def _options(args: argparse.Namespace) -> dict:
    options = {**load_config(RECIPE).model.options, "max_position_embeddings": max(args.tokens, 32768)}
    if args.heads:
        options.update(num_heads=args.heads, num_kv_heads=args.kv_heads or args.heads)
    return options


def _worker(rank: int, world: int, layout: tuple[int, int, int], args: argparse.Namespace, port: int,
            queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sp, a, b = layout
    torch.manual_seed(0)
    _, model = build_model("llm", _options(args))
    parallel = ParallelConfig(sp=sp, cp=a * b, cp_mesh=[a, b] if a * b > 1 else [])
    meshes = build_mesh(ParallelDims.resolve(parallel, world), "cpu")
    model = parallelize(model, parallel, meshes, "cpu")
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, 8192, (min(args.sample, args.tokens - i),), generator=generator).tolist()
               for i in range(0, args.tokens, args.sample)]
    batch = shard_batch(pack_samples(samples), meshes.row_split, LM_CONTRACT)

    def step() -> float:
        start = time.perf_counter()
        logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], batch["max_seqlen"])
        torch.nn.functional.cross_entropy(logits, batch["labels"], ignore_index=-100).backward()
        dist.barrier()
        return time.perf_counter() - start

    with COMM_COUNTER.measure() as counter:  # the warm-up step is the counted one
        step()
        sent = sum(counter.bytes[kind] for kind in KINDS)
    times = [step() for _ in range(args.repeats)]
    queue.put((rank, statistics.median(times), sent))
    dist.destroy_process_group()


def measure(layout: tuple[int, int, int], args: argparse.Namespace) -> tuple[float, list[int]]:
    """(median step seconds of the slowest rank, bytes each rank sent in one step)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, args.ranks, layout, args, port, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    return max(r[1] for r in results), [r[2] for r in results]


def layouts(attn: AttentionShape, ranks: int) -> list[tuple[int, int, int]]:
    """Ulysses first (the baseline), ring, mesh shapes with 1 < a < N, Ulysses 2 x ring."""
    fits = set(split_layouts(attn, ranks))
    wanted = [(ranks, 1, 1), (1, 1, ranks), *((1, a, b) for a, b in mesh_shapes(ranks) if 1 < a < ranks)]
    if ranks % 2 == 0 and ranks >= 4:
        wanted.append((2, 1, ranks // 2))
    return [layout for layout in wanted if layout in fits]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens in the row")
    parser.add_argument("--sample", type=int, default=3000, help="tokens per packed sample")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps after the counted warm-up")
    parser.add_argument("--heads", type=int, default=0, help="query heads (default: the recipe's)")
    parser.add_argument("--kv-heads", type=int, default=0)
    args = parser.parse_args()
    options = _options(args)
    head_dim = options.get("head_dim") or options["hidden_size"] // options["num_heads"]
    attn = AttentionShape(options["num_layers"], options["num_heads"], options["num_kv_heads"], head_dim)
    print(f"{args.ranks} ranks, one row of {args.tokens:,} tokens (samples of {args.sample}), {attn.layers} layers, "
          f"{attn.heads} / {attn.kv_heads} heads x {attn.head_dim}, fp32, 1 thread per rank")
    print(f"{'method':<24}{'sp':>3}{'cp':>3}  {'step s':>8}{'vs Ulysses':>11}  {'bytes/step/rank':>16}"
          f"{'formula':>14}")
    baseline = None
    for layout in layouts(attn, args.ranks):
        seconds, sent = measure(layout, args)
        formula = split_cost(attn, args.tokens, *layout, elem_bytes=4, checkpointing="none")
        if formula.name == "Ulysses":
            baseline = seconds
        ratio = f"{seconds / baseline:11.2f}" if baseline else f"{'-':>11}"
        counted = f"{sent[0]:,}" if len(set(sent)) == 1 else f"{min(sent):,}-{max(sent):,}"
        print(f"{formula.name:<24}{formula.sp:>3}{formula.cp:>3}  {seconds:8.2f}{ratio}  {counted:>16}"
              f"{formula.comm_bytes:>14,}", flush=True)
    if baseline is None:
        print(f"(no Ulysses over {args.ranks}: {attn.heads} heads do not split that way; no baseline)")


if __name__ == "__main__":
    main()
