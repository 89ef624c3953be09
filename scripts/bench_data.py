"""Data at scale, measured: read I/O per epoch, resume cost, and rank imbalance with and without
grouped reordering, each against a baseline taken in the same job.

    python scripts/bench_data.py [--steps 30] [--skip-runs | --only-runs] [--sim-ranks 8 64 1024]
                                 [--section.key value ...]   (recipe overrides for the real runs)

1. I/O: total bytes read from the shards in one epoch of the bundled stdlib corpus (tar shards of
   ~8 MB) by 1, 2 and 4 data-parallel ranks, counted by the loader, against the corpus size (the
   loader before shard-level reading read it once per rank: 1x, 2x, 4x).
2. Resume: wall time and bytes read to the first batch after resuming at 10% and at 90% of an
   epoch of that corpus.
3. Simulation (``veomni.data.balance_sim``) of 8 to 1,024 ranks drawing a long-tailed text/image
   mix, with the text cost coefficients of the quick-start mixture recipe's own model (its cost
   model: dense FLOPs per token and attention FLOPs per causal pair): imbalance (max / mean rank
   cost) of token packing, per-rank cost fill and grouped reordering.
4. Real runs: ``recipes/quickstart/tiny_llm_mixture.yaml`` (70% short stdlib modules, 30% whole
   packages cut at max_seq_len) through ``scripts/train.sh`` on 2 processes of one thread each,
   with ``data.balance`` off (packing by tokens) and on: median step time (the slowest rank's),
   tokens/s, and the measured imbalance of the ranks' own compute time (outside collectives).
   Other arguments are recipe overrides for these runs (``--data.max_seq_len 2048``).

Take figures with nothing else running: a busy machine hides or invents imbalance.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from veomni.config.load import load_config  # noqa: E402
from veomni.data.balance_sim import POLICIES, CostModel, DataMix, SimConfig, simulate  # noqa: E402
from veomni.data.build_loader import build_dataloader  # noqa: E402
from veomni.data.text.packed import load_tokenizer  # noqa: E402

RECIPE = REPO / "recipes" / "quickstart" / "tiny_llm_mixture.yaml"
CORPUS = REPO / "data" / "cache" / "stdlib"


def _corpus() -> Path:
    if not (CORPUS / "train").is_dir():
        subprocess.run([sys.executable, str(REPO / "data" / "build_stdlib_corpus.py"), "--train-out",
                        str(CORPUS / "train"), "--eval-out", str(CORPUS / "eval")], check=True)
    return CORPUS / "train"


def bench_io(tokenizer) -> None:
    cfg = load_config(RECIPE).data
    cfg = replace(cfg, sources=[], train_path=str(_corpus()), eval_path=str(_corpus()), shuffle_window=1)
    size = sum(f.stat().st_size for f in _corpus().glob("*.tar"))
    print(f"## 1. Bytes read per epoch ({len(list(_corpus().glob('*.tar')))} tar shards, {size / 1e6:.1f} MB)\n")
    print("| ranks | bytes read | / corpus | samples | before (every rank read all) |")
    print("|---|---|---|---|---|")
    for ranks in (1, 2, 4):
        read, samples = 0, 0
        for rank in range(ranks):
            loader = build_dataloader(cfg, "eval", tokenizer, rank, ranks, 0)
            samples += sum(batch["num_samples"] for batch in loader)
            read += loader.dataset.bytes_read
        print(f"| {ranks} | {read:,} | {read / size:.4f} | {samples} | {ranks}.0000 |")


def bench_resume(tokenizer) -> None:
    cfg = load_config(RECIPE).data
    cfg = replace(cfg, sources=[], train_path=str(_corpus()), eval_path=str(_corpus()))
    batches = sum(1 for _ in build_dataloader(cfg, "eval", tokenizer, 0, 1, 0))
    print(f"\n## 2. Resume cost (one epoch = {batches} micro-batches, shuffle_window {cfg.shuffle_window})\n")
    print("| resumed at | batches before | seconds to first batch | bytes read to first batch |")
    print("|---|---|---|---|")
    for fraction in (0.1, 0.9):
        loader = build_dataloader(cfg, "train", tokenizer, 0, 1, 0)
        it = iter(loader)
        for _ in range(int(batches * fraction)):
            next(it)
        state = loader.state_dict()
        started = time.perf_counter()
        resumed = build_dataloader(cfg, "train", tokenizer, 0, 1, 0)
        resumed.load_state_dict(state)
        next(iter(resumed))
        seconds = time.perf_counter() - started
        print(f"| {fraction:.0%} | {int(batches * fraction)} | {seconds:.3f} | {resumed.dataset.bytes_read:,} |")


def recipe_costs() -> CostModel:
    """The simulation's text cost in the recipe model's own terms: FLOPs per token of its dense
    layers (1 unit) and its attention FLOPs per causal pair, from the family's cost model."""
    import torch

    from veomni.contract import build_model, get_model_spec

    cfg = load_config(RECIPE)
    with torch.device("meta"):
        _, model = build_model(cfg.model.arch, cfg.model.options)
    f = get_model_spec(cfg.model.arch).cost.sample_flops
    per_token = 3 * f(model, 1) - f(model, 2)
    per_pair = f(model, 2) - 2 * f(model, 1)
    return CostModel(attention=per_pair / 2 / per_token)


def bench_simulation(ranks: list[int]) -> None:
    costs, mix = recipe_costs(), DataMix()
    config = SimConfig(ranks=ranks[0])
    print(f"\n## 3. Simulated imbalance (max / mean rank cost), {costs}\n{mix}\n{config}\n")
    print("| ranks | " + " | ".join(f"{p} mean | {p} worst" for p in POLICIES) + " |")
    print("|---|" + "---|---|" * len(POLICIES))
    for count in ranks:
        results = simulate(replace(config, ranks=count), mix, costs)
        cells = " | ".join(f"{statistics.mean(results[p].imbalance):.3f} | {max(results[p].imbalance):.3f}"
                           for p in POLICIES)
        print(f"| {count} | {cells} |", flush=True)


def _run(work: Path, balance: bool, steps: int, overrides: list[str]) -> list[dict]:
    out = work / ("balanced" if balance else "tokens")
    env = {**os.environ, "NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1"}
    cmd = ["bash", str(REPO / "scripts" / "train.sh"), str(RECIPE), "--data.balance", str(balance).lower(),
           "--train.max_steps", str(steps), "--train.output_dir", str(out), "--train.eval_interval", "0",
           "--train.eval_batches", "1", "--checkpoint.save_final", "false", "--checkpoint.interval", "0",
           "--log.interval", "1", "--train.straggler_window", "5", *overrides]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"train.sh failed:\n{result.stderr[-3000:]}")
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "step_time_s" in r]


def bench_runs(steps: int, overrides: list[str]) -> None:
    print(f"\n## 4. Real runs: {RECIPE.name} {' '.join(overrides)}, 2 processes x 1 thread, {steps} steps "
          "(medians of steps 6 on)\n")
    print("| data.balance | step time s (slowest rank) | tokens/s | tokens/step | own-time max/min (5-step windows) |")
    print("|---|---|---|---|---|")
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for balance in (False, True):
            records = _run(Path(tmp), balance, steps, overrides)[5:]
            figures[balance] = (statistics.median(r["step_time_s"] for r in records),
                                statistics.median(r["tokens_per_s"] for r in records),
                                statistics.median(r["tokens"] for r in records),
                                statistics.median(r["slowest_ratio"] for r in records if "slowest_ratio" in r))
            time_s, rate, tokens, ratio = figures[balance]
            print(f"| {balance} | {time_s:.3f} | {rate:,.0f} | {tokens:,.0f} | {ratio:.3f} |", flush=True)
    print(f"\ntokens/s balanced / by tokens: {figures[True][1] / figures[False][1]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sim-ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--skip-runs", action="store_true", help="no real training runs (sections 1-3 only)")
    parser.add_argument("--only-runs", action="store_true", help="section 4 only")
    args, overrides = parser.parse_known_args()
    if not args.only_runs:
        tokenizer = load_tokenizer(str(REPO / "data" / "tokenizers" / "stdlib-bpe-8k"))
        bench_io(tokenizer)
        bench_resume(tokenizer)
        bench_simulation(args.sim_ranks)
    if not args.skip_runs:
        bench_runs(args.steps, overrides)


if __name__ == "__main__":
    main()
