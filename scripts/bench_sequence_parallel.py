"""Ulysses sequence parallelism on this machine: step time and memory per rank by SP size.

    python scripts/bench_sequence_parallel.py [--tokens 4096 8192 16384] [--sp 1 2 4]

For each SP size and row length T it runs forward+backward of the long-context recipe's
model on one packed row of T tokens (samples of 8k tokens), spread over ``sp`` processes
(one thread each), and prints the median step time, the ratio to sp=1 at the same T, and
each rank's peak memory. Memory grows linearly in the tokens a rank holds (the attention
kernel is blocked), so the slope between two lengths gives the memory per token, and
``usable memory / slope`` the longest row a rank could hold: printed as "max tokens/rank".
"""

from __future__ import annotations

import argparse
import os
import resource
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
from veomni.parallel.mesh import ParallelDims, build_mesh  # noqa: E402
from veomni.parallel.row_split import RowSplit, shard_batch  # noqa: E402
from veomni.tasks import LM_CONTRACT  # noqa: E402

RECIPE = REPO / "recipes" / "long-context" / "tiny_32k.yaml"
SAMPLE = 8192


def _worker(rank: int, sp: int, tokens: int, port: int, repeats: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(sp))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=sp)
    cfg = load_config(RECIPE)
    options = {**cfg.model.options, "max_position_embeddings": max(tokens, SAMPLE)}
    torch.manual_seed(0)
    _, model = build_model("llm", options)
    parallel = ParallelConfig(sp=sp)
    model = parallelize(model, parallel, build_mesh(ParallelDims.resolve(parallel, sp), "cpu"), "cpu")
    samples = [torch.randint(0, 8192, (min(SAMPLE, tokens - i),)).tolist() for i in range(0, tokens, SAMPLE)]
    batch = shard_batch(pack_samples(samples), RowSplit(sp_rank=rank, sp=sp), LM_CONTRACT)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], batch["max_seqlen"])
        torch.nn.functional.cross_entropy(logits, batch["labels"], ignore_index=-100).backward()
        dist.barrier()
        times.append(time.perf_counter() - start)
    queue.put((rank, statistics.median(times[1:]), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20))
    dist.destroy_process_group()


def measure(sp: int, tokens: int, repeats: int) -> tuple[float, float]:
    """(median step seconds, max peak GiB over ranks)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, sp, tokens, port, repeats, queue)) for r in range(sp)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
    return max(r[1] for r in results), max(r[2] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--memory-gib", type=float, default=20.0, help="usable memory of the machine")
    args = parser.parse_args()
    rows = {}
    print(f"{'sp':>3} {'tokens':>7} {'tok/rank':>8} {'step s':>8} {'vs sp=1':>8} {'peak GiB/rank':>14}")
    for tokens in args.tokens:
        for sp in args.sp:
            seconds, peak = measure(sp, tokens, args.repeats)
            rows[sp, tokens] = (seconds, peak)
            base = rows.get((1, tokens), (seconds,))[0]
            print(f"{sp:>3} {tokens:>7} {tokens // sp:>8} {seconds:>8.2f} {seconds / base:>8.2f} {peak:>14.2f}",
                  flush=True)
    low, high = min(args.tokens), max(args.tokens)
    if low != high:
        print("\nmemory slope and the longest row per rank that fits (extrapolated):")
        for sp in args.sp:
            slope = (rows[sp, high][1] - rows[sp, low][1]) / ((high - low) / sp)  # GiB per token held
            base = rows[sp, low][1] - slope * low / sp
            per_rank_budget = args.memory_gib / sp
            max_tokens = (per_rank_budget - base) / slope if slope > 0 else float("inf")
            print(f"  sp={sp}: {slope * 2**30 / 1e3:.1f} kB/token, {per_rank_budget:.1f} GiB per rank -> "
                  f"max ~{max_tokens:,.0f} tokens/rank, ~{max_tokens * sp:,.0f} tokens per row")


if __name__ == "__main__":
    main()
