"""Small-scale VWN reproduction: train the recipes/vwn/sweep_*.yaml points, tabulate and plot.

    bash scripts/vwn_sweep.sh [--out outputs/vwn_sweep] [--only baseline r2 ...] [--max-steps N]
    bash scripts/vwn_sweep.sh --summarise-only [--only ...]   # table and plots of finished runs

Each recipe trains in turn through ``scripts/train.sh`` (same backbone, data, schedule and
token budget; only the virtual width differs). Then it writes, under ``--out``:

- ``table.md`` and ``results.json``: per run its (m, n), r, parameters, FLOPs/token, tokens
  seen, training wall time (trainer start to last metric), the final training next-token and
  next-2-token losses (mean of the last 10% of steps: every batch is new data, and training
  loss is what the paper plots) and the final held-out ones, with their differences to the
  baseline; and the least-squares fit of each against log2 r (baseline at r = 1), slope, R^2;
- ``loss_vs_tokens_ntp.png`` / ``loss_vs_tokens_mtp.png``: training loss against tokens seen
  per width (moving average over 10 steps, from a fifth of the token budget on);
- ``final_loss_vs_log2r.png``: the final losses against log2 r with the fitted lines.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from _plot import Series, line_chart  # noqa: E402

import models  # noqa: E402,F401  (registers the zoo)
from veomni.config.load import load_config  # noqa: E402
from veomni.contract import build_model  # noqa: E402

RUNS = ("baseline", "r1p5", "r2", "r4", "r8")


def describe(recipe: Path) -> dict:
    """(m, n), r, parameter count and FLOPs/token of a recipe's model (built on meta)."""
    cfg = load_config(recipe)
    with torch.device("meta"):
        model_cfg, model = build_model(cfg.model.arch, cfg.model.options)
    seq = cfg.data.max_seq_len
    return {"m": model_cfg.vwn_m, "n": model_cfg.vwn_n, "r": model_cfg.vwn_n / model_cfg.vwn_m,
            "params": sum(p.numel() for p in model.parameters()),
            "flops_per_token": model.training_flops([seq]) / seq}


def train(name: str, out: Path, max_steps: int | None) -> None:
    """Train one recipe from scratch into ``out/name``."""
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = ["bash", str(REPO / "scripts" / "train.sh"), str(REPO / "recipes" / "vwn" / f"sweep_{name}.yaml"),
           "--train.output_dir", str(run_dir)]
    if max_steps:
        cmd += ["--train.max_steps", str(max_steps)]
    env = {**os.environ, "NPROC_PER_NODE": os.environ.get("NPROC_PER_NODE", "1")}
    print(f"[sweep] {name}: {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=REPO)


def training_wall_s(run_dir: Path) -> float:
    """Seconds from the trainer's start (it writes config.yaml) to its last metric (incl. final eval)."""
    return (run_dir / "metrics.jsonl").stat().st_mtime - (run_dir / "config.yaml").stat().st_mtime


def read_metrics(path: Path) -> tuple[list[dict], dict]:
    """(training records, the last eval record) of a run's metrics.jsonl."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r for r in records if "loss_ntp" in r]
    evals = [r for r in records if "eval_loss_ntp" in r]
    return steps, evals[-1]


def fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least-squares ``y = slope * x + intercept``; returns (slope, intercept, R^2)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    ss_res = sum((y - slope * x - intercept) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return slope, intercept, 1 - ss_res / ss_tot if ss_tot else 1.0


def moving_average(values: list[float], window: int = 10) -> list[float]:
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def summarise(runs: list[dict], out: Path) -> str:
    """Write table.md, results.json and the plots; return the table text."""
    base = next((r for r in runs if r["name"] == "baseline"), None)
    keys = (("train_ntp", "train next-token"), ("train_mtp", "train next-2-token"),
            ("eval_ntp", "held-out next-token"), ("eval_mtp", "held-out next-2-token"))
    lines = ["| run | (m, n) | r | params | GFLOPs/token | tokens seen | wall s | "
             + " | ".join(f"{label} | Δ" for _, label in keys) + " |", "|---" * (7 + 2 * len(keys)) + "|"]
    for r in runs:
        mn = "–" if r["name"] == "baseline" else f"({r['m']}, {r['n']})"
        cells = [f"{r[k]:.4f} | {r[k] - base[k]:+.4f}" if base else f"{r[k]:.4f} | –" for k, _ in keys]
        lines.append(f"| {r['name']} | {mn} | {r['r']:g} | {r['params']:,} | "
                     f"{r['flops_per_token'] / 1e9:.4f} | {r['tokens_seen']:,} | {r['wall_s']:.0f} | "
                     + " | ".join(cells) + " |")
    fits = {}
    if len(runs) >= 3:
        xs = [math.log2(r["r"]) for r in runs]
        ends = [min(xs), max(xs)]
        series = []
        for i, (key, label) in enumerate(keys):
            slope, intercept, r2 = fit(xs, [r[key] for r in runs])
            fits[key] = {"slope": slope, "intercept": intercept, "r2": r2}
            lines.append(f"\nFit {label}: loss = {slope:+.4f} * log2(r) + {intercept:.4f}, R^2 = {r2:.4f}")
            series += [Series(label, xs, [r[key] for r in runs], line=False, color=i),
                       Series(f"fit {slope:+.4f}/doubling", ends, [intercept + slope * x for x in ends],
                              color=i)]
        line_chart(str(out / "final_loss_vs_log2r.png"), "final loss vs log2 r", "log2 r", "loss", series,
                   size=(860, 520))
    for key, label in (("curve_ntp", "next-token"), ("curve_mtp", "next-2-token")):
        # from a fifth of the budget on: the first steps' drop from ~9 would flatten the gaps
        series = []
        for r in runs:
            start = next(i for i, t in enumerate(r["curve_tokens"]) if t >= 0.2 * r["curve_tokens"][-1])
            series.append(Series(f"{r['name']} (r={r['r']:g})", r["curve_tokens"][start:], r[key][start:]))
        line_chart(str(out / f"loss_vs_tokens_{key[-3:]}.png"),
                   f"training {label} loss (moving avg 10 steps, from 20% of the tokens)", "tokens seen",
                   "loss", series)
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps({"runs": runs, "fits": fits}, indent=1))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "vwn_sweep")
    parser.add_argument("--only", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--max-steps", type=int, default=None, help="override every recipe's train.max_steps")
    parser.add_argument("--summarise-only", action="store_true", help="no training: summarise finished runs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    runs = []
    for name in args.only:
        if not args.summarise_only:
            train(name, args.out, args.max_steps)
        steps, last_eval = read_metrics(args.out / name / "metrics.jsonl")
        tail = steps[-max(1, len(steps) // 10):]
        runs.append({
            "name": name, **describe(REPO / "recipes" / "vwn" / f"sweep_{name}.yaml"),
            "wall_s": training_wall_s(args.out / name),
            "tokens_seen": steps[-1]["tokens_seen"],
            "train_ntp": sum(s["loss_ntp"] for s in tail) / len(tail),
            "train_mtp": sum(s["loss_mtp"] for s in tail) / len(tail),
            "eval_ntp": last_eval["eval_loss_ntp"], "eval_mtp": last_eval["eval_loss_mtp"],
            "curve_tokens": [s["tokens_seen"] for s in steps],
            "curve_ntp": moving_average([s["loss_ntp"] for s in steps]),
            "curve_mtp": moving_average([s["loss_mtp"] for s in steps]),
        })
    print(summarise(runs, args.out))
    print(f"\n[sweep] {len(runs)} runs in {time.time() - start:.0f} s; outputs in {args.out}")


if __name__ == "__main__":
    main()
