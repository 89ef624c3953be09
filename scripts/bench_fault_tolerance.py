"""What fault tolerance costs on this machine, as ratios against a baseline run in the same job.

    python scripts/bench_fault_tolerance.py [--steps 30] [--kill-step 15] [--interval 10]

1. Restart: the quick-start model trained through ``bash scripts/train.sh`` (2 processes) once
   uninterrupted and once with rank 1 SIGKILLed at ``--kill-step``. Prints both wall times, their
   ratio, and the restart's cost split into the steps run again and everything else (stopping the
   group, starting it, resuming from the checkpoint).
2. Checksums: one process saves a checkpoint of a larger model (weights + AdamW state) through the
   ``CheckpointManager``, which hashes every file at publish; prints the time of the hashing
   against the whole save, and the hashing rate.
3. Watchdog: forward+backward steps of a small model with the watchdog thread armed (it samples
   the main thread's stack every ``SAMPLE_S``) against the same steps unwatched.

Take figures with nothing else running: the watchdog and restart ratios are sensitive to load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QUICKSTART = REPO / "recipes" / "quickstart" / "tiny_llm.yaml"
SMALL = ["--model.hidden_size", "64", "--model.intermediate_size", "128", "--model.num_layers", "2",
         "--model.num_heads", "4", "--model.num_kv_heads", "2", "--model.head_dim", "16",
         "--data.tokens_per_micro_batch", "512", "--data.max_seq_len", "256", "--train.eval_batches", "1",
         "--train.sample_tokens", "6", "--train.eval_interval", "0"]


def _train(out: Path, steps: int, interval: int, faults: str) -> tuple[float, list[dict]]:
    env = {**os.environ, "NPROC_PER_NODE": "2", "VEOMNI_FAULTS": faults}
    start = time.perf_counter()
    result = subprocess.run(["bash", str(REPO / "scripts" / "train.sh"), str(QUICKSTART), *SMALL,
                             "--train.max_steps", str(steps), "--checkpoint.interval", str(interval),
                             "--train.output_dir", str(out)], cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"train.sh failed:\n{result.stderr[-3000:]}")
    return wall, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def bench_restart(steps: int, kill_step: int, interval: int, work: Path) -> None:
    base_wall, base = _train(work / "uninterrupted", steps, interval, "")
    kill_wall, killed = _train(work / "killed", steps, interval, f"kill:rank=1:step={kill_step}")
    step_s = statistics.median(r["step_time_s"] for r in base if "step_time_s" in r)
    lost = next(r["steps_lost"] for r in killed if "steps_lost" in r)
    extra = kill_wall - base_wall
    print(f"restart: uninterrupted {base_wall:.1f} s, rank 1 killed at step {kill_step}: {kill_wall:.1f} s "
          f"(x{kill_wall / base_wall:.2f}); cost {extra:.1f} s = {lost} step(s) run again "
          f"({lost * step_s:.2f} s at the median {step_s * 1e3:.0f} ms/step) + {extra - lost * step_s:.1f} s to stop, "
          "restart and resume the group")


def _one_rank_group() -> None:
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def bench_checksums(work: Path, hidden: int) -> None:
    from veomni.checkpoint.manager import CheckpointManager
    from veomni.checkpoint.verify import checkpoint_files, digest

    model = torch.nn.Sequential(*(torch.nn.Linear(hidden, hidden) for _ in range(8)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, hidden)).sum().backward()
    optimizer.step()
    manager = CheckpointManager(work / "checkpoints", keep_last=1, async_save=False, layout={})
    start = time.perf_counter()
    manager.save(1, model, optimizer, {}, {"dp_rank": 0})
    save_s = time.perf_counter() - start
    folder = work / "checkpoints" / "step_00000001"
    start = time.perf_counter()
    total = sum(digest(folder / name)["size"] for name in checkpoint_files(folder))
    hash_s = time.perf_counter() - start
    print(f"checksums: a {total / 2**30:.2f} GiB checkpoint saved in {save_s:.2f} s, of which hashing "
          f"{hash_s:.2f} s ({hash_s / save_s:.0%}; {total / hash_s / 2**20:.0f} MiB/s on one rank)")


def bench_watchdog(repeats: int, rounds: int = 5) -> None:
    from veomni.train.fault.watchdog import Watchdog

    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(6)))
    batch = torch.randn(256, 512)

    def steps() -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(batch).square().mean().backward()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    steps()  # warm-up
    plain, watched = [], []
    for _ in range(rounds):  # alternated, so drift in the machine's speed hits both alike
        plain.append(steps())
        with tempfile.TemporaryDirectory() as reports:
            watchdog = Watchdog(600.0, Path(reports), 0, "gloo", armed=True)
            watched.append(steps())
            watchdog.stop()
    ratios = sorted(w / p for w, p in zip(watched, plain))
    print(f"watchdog: median step {statistics.median(plain) * 1e3:.2f} ms unwatched, "
          f"{statistics.median(watched) * 1e3:.2f} ms watched (x{statistics.median(ratios):.3f}; "
          f"rounds x{ratios[0]:.3f} to x{ratios[-1]:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-step", type=int, default=15)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=2048, help="checksum benchmark: width of its 8 layers")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench_ft_"))
    try:
        bench_watchdog(args.repeats)
        _one_rank_group()
        bench_checksums(work, args.hidden)
        bench_restart(args.steps, args.kill_step, args.interval, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
