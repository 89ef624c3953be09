"""Measured vs analytic pipeline bubble, per schedule, on this machine.

    python scripts/bench_pipeline.py [--pp 2] [--microbatches 4 8] [--layers 8] [--hidden 256]
                                     [--tokens 512] [--repeats 3]

For each schedule it runs training steps of a small decoder (``--layers`` blocks of width
``--hidden``; one packed row of ``--tokens`` tokens per micro-batch) cut into ``pp`` (x2 for
the multi-stage schedules) stages, one process per pipeline rank with one thread each, through
the engine's own path (``build_pipeline``, FSDP over the stage's ranks, ``Pipeline.step``).

Measured bubble of a rank = 1 - (time inside its stages' forward, backward and weight-gradient
chunks) / (step wall time): the share of the step the rank spent waiting for activations or
gradients, or in communication. Reported: the mean over ranks, the median over ``--repeats``
steps (after one warm-up step), next to the schedule's analytic bubble
(``veomni.parallel.pipeline.layout.analytic_bubble``: unit-cost forward, input-gradient and
weight-gradient, free communication). On a shared CPU the measured figures are noisy.
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
from veomni.config.schema import ParallelConfig  # noqa: E402
from veomni.contract import build_model  # noqa: E402
from veomni.data.packing import pack_samples  # noqa: E402
from veomni.parallel.apply import PIPELINE_HOOKS, parallelize  # noqa: E402
from veomni.parallel.mesh import ParallelDims, build_mesh  # noqa: E402
from veomni.parallel.pipeline.layout import analytic_bubble, check_pipeline, virtual_stages  # noqa: E402
from veomni.parallel.pipeline.stages import build_pipeline  # noqa: E402
from veomni.tasks import LanguageModelingTask  # noqa: E402

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
COMPUTE = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def _timed(method, account: list[float]):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            account[0] += time.perf_counter() - start
    return wrapper


def _worker(rank: int, args, schedule: str, microbatches: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.pp))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.pp)
    parallel = ParallelConfig(pp=args.pp, pp_schedule=schedule)
    meshes = build_mesh(ParallelDims.resolve(parallel, args.pp), "cpu")
    options = dict(vocab_size=2048, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                   num_layers=args.layers, num_heads=8, num_kv_heads=4, head_dim=args.hidden // 8,
                   max_position_embeddings=args.tokens, tie_embeddings=False)

    def build():
        torch.manual_seed(0)
        return build_model("llm", options)[1]

    task = LanguageModelingTask()
    pipe = build_pipeline(build, lambda m: m.init_weights(), lambda m: parallelize(m, parallel, meshes, "cpu"),
                          parallel, microbatches, meshes.pp, torch.device("cpu"), task, hooks=PIPELINE_HOOKS)
    compute = [0.0]
    for stage in pipe.stages:
        for name in COMPUTE:
            setattr(stage, name, _timed(getattr(stage, name), compute))
    gen = torch.Generator().manual_seed(1)
    rows = [pack_samples([torch.randint(0, 2048, (args.tokens // 2,), generator=gen).tolist()
                          for _ in range(2)]) for _ in range(microbatches)]
    bubbles = []
    for step in range(args.repeats + 1):
        dist.barrier()
        compute[0] = 0.0
        start = time.perf_counter()
        pipe.step(rows, 1.0 / (microbatches * args.tokens))
        wall = time.perf_counter() - start
        for part in pipe.parts:
            part.zero_grad(set_to_none=True)
        if step:
            bubbles.append((1 - compute[0] / wall, wall))
    gathered = [None] * args.pp
    dist.all_gather_object(gathered, bubbles)
    if rank == 0:
        per_step = [(statistics.mean(r[i][0] for r in gathered), max(r[i][1] for r in gathered))
                    for i in range(args.repeats)]
        queue.put((statistics.median(b for b, _ in per_step), statistics.median(w for _, w in per_step)))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    print(f"pp={args.pp}, {args.layers} layers x width {args.hidden}, {args.tokens} tokens per micro-batch, "
          f"{os.cpu_count()} CPU cores, one thread per rank; median of {args.repeats} steps (noisy on a shared CPU)")
    print(f"{'schedule':<24}{'stages':>7}{'m':>4}{'step s':>9}{'measured':>10}{'analytic':>10}")
    for m in args.microbatches:
        for schedule in SCHEDULES:
            parallel = ParallelConfig(pp=args.pp, pp_schedule=schedule)
            try:
                check_pipeline(parallel, m, num_blocks=args.layers)
            except ValueError as exc:
                print(f"{schedule:<24}{'':>7}{m:>4}  skipped: {exc}")
                continue
            queue = ctx.Queue()
            port = _free_port()
            procs = [ctx.Process(target=_worker, args=(r, args, schedule, m, port, queue)) for r in range(args.pp)]
            for proc in procs:
                proc.start()
            bubble, wall = queue.get(timeout=900)
            for proc in procs:
                proc.join()
            v = virtual_stages(parallel)
            print(f"{schedule:<24}{args.pp * v:>7}{m:>4}{wall:>9.3f}{bubble:>10.3f}"
                  f"{analytic_bubble(schedule, args.pp, m, v):>10.3f}", flush=True)


if __name__ == "__main__":
    main()
