"""The quick start (recipes/quickstart/tiny_llm.yaml) with Muon against AdamW at the same tokens.

    bash scripts/muon_sweep.sh [--out outputs/muon_sweep] [--lrs LR ...] [--adamw-lrs LR ...] [--muon-lrs LR ...]
        [--max-steps N]
        [--warmup-steps N] [--eval-interval N] [--eval-batches N] [--summarise-only] [--keep-finished]

Every (optimizer, lr) trains from the same initialisation on the same batches through
``scripts/train.sh`` (``NPROC_PER_NODE`` processes, default 1), evaluating every
``--eval-interval`` steps on the same held-out micro-batches, one thread per process
(``OMP_NUM_THREADS``, default 1). Per optimizer the tuned lr is the one
with the lowest final eval loss; the table gives each run's final eval loss and median step time
(separate runs: on a shared machine their times are not comparable; ``scripts/bench_muon.py`` times
both optimizers in one job), and the tokens the tuned Muon run needed to reach the tuned AdamW
run's final eval loss (the first evaluation at or below it, so the resolution is one eval
interval). Written to ``--out``/table.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OPTIMIZERS = ("adamw", "muon")
# Around each optimizer's optimum at the recipe's 400 steps (the quick start itself trains AdamW at 1e-3;
# at 400 steps AdamW is better at 2e-3 than at 6e-3, Muon takes larger rates): one point either side.
DEFAULT_LRS = {"adamw": ["6e-4", "2e-3", "6e-3"], "muon": ["2e-3", "6e-3", "2e-2", "6e-2"]}


def run_dir(out: Path, optimizer: str, lr: str) -> Path:
    return out / f"{optimizer}_lr{lr}"


def train(out: Path, optimizer: str, lr: str, args: argparse.Namespace) -> None:
    target = run_dir(out, optimizer, lr)
    shutil.rmtree(target, ignore_errors=True)
    cmd = ["bash", "scripts/train.sh", "recipes/quickstart/tiny_llm.yaml", "--train.optimizer", optimizer,
           "--train.lr", lr, "--train.output_dir", str(target), "--checkpoint.interval", "0",
           "--train.eval_interval", str(args.eval_interval), "--train.eval_batches", str(args.eval_batches)]
    if args.max_steps:
        cmd += ["--train.max_steps", str(args.max_steps)]
    if args.warmup_steps is not None:
        cmd += ["--train.warmup_steps", str(args.warmup_steps)]
    print(f"[muon_sweep] {' '.join(cmd)}", flush=True)
    # One thread per process unless told otherwise: on a shared machine two OpenMP threads per process
    # wait on each other's barriers (a quick-start step measured 7x slower at load average ~10 with 2
    # threads than with 1, same losses), which made separate runs' step times incomparable.
    env = {**os.environ, "NPROC_PER_NODE": os.environ.get("NPROC_PER_NODE", "1"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd, check=True, cwd=REPO, env=env)


def finished(out: Path, optimizer: str, lr: str) -> bool:
    metrics = run_dir(out, optimizer, lr) / "metrics.jsonl"
    return metrics.exists() and "eval_loss" in json.loads(metrics.read_text().splitlines()[-1])


def read_run(out: Path, optimizer: str, lr: str) -> dict:
    records = [json.loads(line) for line in (run_dir(out, optimizer, lr) / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["tokens_seen"], r["eval_loss"]) for r in records if "eval_loss" in r]
    steps = [r["step_time_s"] for r in records if "step_time_s" in r][2:]  # the first two warm up
    return {"optimizer": optimizer, "lr": lr, "evals": evals, "final_eval": evals[-1][1],
            "tokens": evals[-1][0], "step_s": statistics.median(steps)}


def tokens_to_reach(run: dict, loss: float) -> int | None:
    return next((tokens for tokens, value in run["evals"] if value <= loss), None)


def table(runs: list[dict]) -> str:
    best = {name: min((r for r in runs if r["optimizer"] == name), key=lambda r: r["final_eval"])
            for name in OPTIMIZERS}
    lines = ["| optimizer | lr | tokens | final eval loss | median step s |", "|---|---|---|---|---|"]
    for r in runs:
        mark = " (tuned)" if r is best[r["optimizer"]] else ""
        lines.append(f"| {r['optimizer']} | {r['lr']}{mark} | {r['tokens']:,} | {r['final_eval']:.4f} | "
                     f"{r['step_s']:.2f} |")
    adamw, muon = best["adamw"], best["muon"]
    reach = tokens_to_reach(muon, adamw["final_eval"])
    lines.append("")
    lines.append(f"tuned Muon reaches tuned AdamW's final eval loss {adamw['final_eval']:.4f} at "
                 + (f"{reach:,} tokens ({reach / adamw['tokens']:.2f}x AdamW's {adamw['tokens']:,})" if reach
                    else f"no evaluation (its final: {muon['final_eval']:.4f})"))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "muon_sweep")
    parser.add_argument("--lrs", nargs="+", default=None, help="both optimizers' rates (default: per optimizer)")
    parser.add_argument("--adamw-lrs", nargs="+", default=None, help=f"default: {' '.join(DEFAULT_LRS['adamw'])}")
    parser.add_argument("--muon-lrs", nargs="+", default=None, help=f"default: {' '.join(DEFAULT_LRS['muon'])}")
    parser.add_argument("--max-steps", type=int, default=None, help="default: the recipe's 400")
    parser.add_argument("--warmup-steps", type=int, default=None, help="default: the recipe's 20")
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=0, help="0: the whole held-out split")
    parser.add_argument("--summarise-only", action="store_true", help="no training: tabulate finished runs")
    parser.add_argument("--keep-finished", action="store_true",
                        help="train only the runs whose metrics do not end with an evaluation (a sweep resumed "
                             "or widened)")
    args = parser.parse_args()
    out = args.out.resolve()
    runs = []
    for optimizer in OPTIMIZERS:
        for lr in getattr(args, f"{optimizer}_lrs") or args.lrs or DEFAULT_LRS[optimizer]:
            if not args.summarise_only and not (args.keep_finished and finished(out, optimizer, lr)):
                train(out, optimizer, lr, args)
            runs.append(read_run(out, optimizer, lr))
    text = table(runs)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
