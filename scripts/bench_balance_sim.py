"""How evenly three ways of forming micro-batches spread compute over 8 to 1024 data-parallel ranks.

    python scripts/bench_balance_sim.py [--ranks 8 16 64 256 1024] [--steps 10] [--quick]

Simulated, not timed (``veomni.data.balance_sim``): every rank draws its own seeded long-tailed
text/image stream, and each step forms its micro-batches by ``tokens`` (greedy packing in stream
order under the units cap, today's loader), ``cost-fill`` (each rank fills its own micro-batches
towards the cost target from its window) or ``grouped`` (groups of ranks fill all their
micro-batches together). Columns, over the measured steps: the imbalance (max / mean rank cost
over all ranks) mean and worst; ``sync``: the mean over micro-batch rounds of the most expensive
micro-batch of the round over the mean micro-batch (ranks wait for each other every micro-batch);
``fill``: mean micro-batch cost / target; the steps samples waited in a window (mean, max); and
the share of samples trained on another rank than the one that drew them. The CPU seconds per
rank count are the simulation's own cost; the last line times ``fill_bins`` on one group's windows
(wall time, so it varies with the machine's load).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import replace
from itertools import islice
from statistics import mean, median

from veomni.data.balance import Candidate, fill_bins
from veomni.data.balance_sim import POLICIES, CostModel, DataMix, PolicyStats, SimConfig, sample_stream, simulate


def row(ranks: int, policy: str, stats: PolicyStats) -> str:
    return (f"| {ranks} | {policy} | {mean(stats.imbalance):.3f} | {max(stats.imbalance):.3f} | {mean(stats.sync):.3f} "
            f"| {mean(stats.fill):.3f} | {stats.mean_wait:.2f} | {max(stats.waits)} | {stats.moved_share:.0%} |")


def fill_bins_milliseconds(mix: DataMix, costs: CostModel, config: SimConfig, per_rank: int, calls: int = 20) -> float:
    """Median wall time of one ``fill_bins`` call over a group's windows of ``per_rank`` samples each
    (drawn from the simulated streams, ages spread over 0..max_wait)."""
    rng = random.Random(config.seed)
    candidates = [Candidate(owner, index, sample.units, sample.cost, rng.randint(0, config.max_wait))
                  for owner in range(config.group_size)
                  for index, sample in enumerate(islice(sample_stream(mix, costs, config.seed, owner), per_rank))]
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fill_bins(candidates, config.group_size, config.micro_batches, config.unit_cap, config.target, config.max_wait)
        times.append(time.perf_counter() - started)
    return median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64, 256, 1024])
    parser.add_argument("--steps", type=int, default=10, help="measured steps")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per rank per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-wait", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 and 64 ranks, 4 measured steps")
    args = parser.parse_args()
    ranks, steps = ([8, 64], 4) if args.quick else (args.ranks, args.steps)
    mix, costs = DataMix(), CostModel()
    base = SimConfig(ranks=ranks[0], micro_batches=args.micro_batches, group_size=args.group_size,
                     max_wait=args.max_wait, steps=steps, warmup_steps=args.warmup_steps, seed=args.seed)
    print(f"{mix}\n{costs}\n{base}, ranks per row\n")
    print("| ranks | policy | imbalance mean | imbalance worst | sync | fill | wait mean | wait max | moved |")
    print("|---|---|---|---|---|---|---|---|---|")
    cpu_seconds = {}
    for count in ranks:
        started = time.process_time()
        results = simulate(replace(base, ranks=count), mix, costs)
        cpu_seconds[count] = time.process_time() - started
        for policy in POLICIES:
            print(row(count, policy, results[policy]), flush=True)
    print("\nCPU seconds per row of ranks: " + ", ".join(f"{count}: {cpu:.1f}" for count, cpu in cpu_seconds.items()))
    per_rank = 200
    milliseconds = fill_bins_milliseconds(mix, costs, base, per_rank)
    print(f"fill_bins for a group of {base.group_size} ranks x {per_rank} candidates, {base.micro_batches} "
          f"micro-batches each: {milliseconds:.1f} ms (median of 20 calls)")

if __name__ == "__main__":
    main()
