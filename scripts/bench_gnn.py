"""GNN parallel modes on this machine: bytes and time per epoch, and GNNPipe's convergence.

    python scripts/bench_gnn.py comm [--recipe recipes/gnnpipe/tiny.yaml] [--layers 8 16 32] [--procs 2 4]
                                     [--epochs 12] [--skip 2] [--chunks-per-stage 2]
    python scripts/bench_gnn.py converge [--recipe recipes/gnnpipe/tiny.yaml] [--seeds 1 2] [--epochs 200]
                                         [--eval-every 10] [--pp 2] [--chunks 4]
                                         [--variants recipe no-refresh fixed-order ...]

Every number comes from real training runs through ``bash scripts/train.sh`` (one per mode,
``NPROC_PER_NODE`` processes, each in its own folder under ``outputs/bench_gnn/<command>/``,
wiped first) and their ``metrics.jsonl``. ``--extra "--model.hidden_size 128 ..."`` adds
overrides to every run. A run that fails is reported with its log and the script exits 1.

``comm``: for each depth L (``model.num_layers``) and process count N, the modes
  single     1 process, the reference (``pp 1``, one micro-batch: the whole graph);
  graph-par  N partitions (``pp 1``, one micro-batch: exact full-graph training);
  gnnpipe    N stages (``pp N``), ``chunks-per-stage x N`` chunks, every epoch chunked
             (``graph_warmup_epochs 0``, ``graph_refresh_every 0``);
  hybrid     (N >= 4, even) 2 stages x N/2 partitions, ``chunks-per-stage x 2`` chunks.
Measured bytes per epoch = the ``comm_bytes_*`` of a step (one step is one epoch), median over the
steady steps (after the first ``--skip``); the analytic figure is the formula of
``veomni/planner/graph_plan.py`` with the model's widths (its ``GraphCost``) and, for the halo,
the actual partition: the run's graph, partitioner and seed, halo rows counted per partition
(the estimate there assumes a random partition). Graph parallelism sends 2 L H d x 4 bytes
(halo rows forward and their gradients back, every layer), GNNPipe 2 (K-1) N w x 4 (every
node's stage state across each boundary and back, whatever L): their ratio grows with L.
Epoch time = median ``step_time_s`` of the steady steps, as a ratio to the single process of the
same depth. On a shared CPU the times are noisy; the bytes are exact.

``converge``: per seed (``train.seed``: weights, partition, chunks and chunk order), the
single-process reference and GNNPipe (``--pp`` stages, ``--chunks`` chunks, ``--pp`` processes)
in each ``--variants`` staleness setting (``VARIANTS``; ``recipe`` keeps the recipe's), each for
``--epochs`` epochs with an eval every ``--eval-every``. Printed: the final test accuracy of each
run, its difference to the reference's (points), the test accuracy at the best validation
accuracy, and the first eval epoch at which the run is within 1 point of the reference's final
test accuracy. Written: the curves as ``converge.csv`` and ``converge.png`` in the output folder.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from _plot import Series, line_chart  # noqa: E402

import models  # noqa: E402,F401  (registers the zoo)
from veomni.config.load import load_config  # noqa: E402
from veomni.config.schema import RunConfig  # noqa: E402
from veomni.contract.families import build_config, get_model_spec  # noqa: E402
from veomni.data.graph.format import load_graph  # noqa: E402
from veomni.data.graph.partition import partition_nodes  # noqa: E402
from veomni.data.graph.views import edge_weights, unique_columns  # noqa: E402

OUT = REPO / "outputs" / "bench_gnn"
RECIPE = "recipes/gnnpipe/tiny.yaml"
EXACT_EPOCHS_OFF = ["--data.graph_warmup_epochs", "0", "--data.graph_refresh_every", "0"]
VARIANTS = {
    "recipe": [],
    "no-refresh": EXACT_EPOCHS_OFF,
    "no-warmup": ["--data.graph_warmup_epochs", "0"],
    "fixed-order": ["--data.graph_chunk_order", "fixed"],
    "no-stale-grads": ["--data.graph_stale_gradients", "false"],
    "none": EXACT_EPOCHS_OFF + ["--data.graph_chunk_order", "fixed", "--data.graph_stale_gradients", "false"],
}
"""GNNPipe staleness settings ``converge --variants`` takes: the recipe's techniques, or one (or
all: ``none``) turned off. Exact epochs = warm-up and periodic refresh (whole graph, no history)."""
WITHIN = 0.01
"""``converge``: a run has caught up once its test accuracy is within this of the reference's final."""


class RunFailed(RuntimeError):
    pass


@dataclass
class Run:
    name: str
    procs: int
    overrides: list[str]
    records: list[dict] = field(default_factory=list)
    cfg: RunConfig | None = None

    @property
    def folder(self) -> Path:
        return OUT / self.name

    @property
    def log(self) -> Path:
        return OUT / f"{self.name}.log"


def train(run: Run, recipe: str, extra: list[str], threads: int | None) -> Run:
    """Run ``train.sh`` for ``run``; fills its metrics records and resolved config."""
    shutil.rmtree(run.folder, ignore_errors=True)
    run.log.parent.mkdir(parents=True, exist_ok=True)
    cmd = ["bash", "scripts/train.sh", recipe, *extra, *run.overrides, "--train.output_dir", str(run.folder)]
    env = {**os.environ, "NPROC_PER_NODE": str(run.procs)}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    print(f"  [{run.name}] NPROC_PER_NODE={run.procs} {shlex.join(cmd)}", file=sys.stderr, flush=True)
    with run.log.open("w") as log:
        code = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    metrics = run.folder / "metrics.jsonl"
    if code != 0 or not metrics.is_file():
        raise RunFailed(f"{run.name}: train.sh exited {code}; log: {run.log}")
    run.records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    run.cfg = load_config(run.folder / "config.yaml")
    return run


def run_all(runs: list[Run], args: argparse.Namespace) -> list[str]:
    """Train each run; the failures' messages (the others keep going)."""
    failures = []
    for run in runs:
        try:
            train(run, args.recipe, args.extra, args.threads)
        except (RunFailed, ValueError) as exc:
            failures.append(str(exc))
            print(f"  FAILED {exc}", file=sys.stderr, flush=True)
    return failures


# ---------------------------------------------------------------------------------------- comm

def steady(run: Run, skip: int) -> list[dict]:
    """Training records after the first ``skip`` steps, eval steps left out."""
    rows = [r for r in run.records if r["step"] > skip and "eval_loss" not in r]
    if not rows:
        raise RunFailed(f"{run.name}: no steady step after skipping {skip} (run more --epochs); log: {run.log}")
    return rows


def measured_bytes(run: Run, skip: int) -> tuple[float, dict[str, float], bool]:
    """(median bytes per epoch, median per kind, whether every steady epoch sent the same)."""
    rows = steady(run, skip)
    kinds = sorted({k for r in rows for k in r if k.startswith("comm_bytes_")})
    totals = [sum(r.get(k, 0) for k in kinds) for r in rows]
    per_kind = {k.removeprefix("comm_bytes_"): statistics.median(r.get(k, 0) for r in rows) for k in kinds}
    return statistics.median(totals), per_kind, len(set(totals)) == 1


def epoch_time(run: Run, skip: int) -> float:
    return statistics.median(r["step_time_s"] for r in steady(run, skip))


@functools.lru_cache(maxsize=8)
def halo_rows(path: str, norm: str, parts: int, method: str, seed: int) -> tuple[int, int]:
    """(nodes, halo rows summed over partitions) of the partition the graph dataset computes:
    the same edges, normalisation, partitioner and seed (``veomni.data.graph.source.prepared_graph``)."""
    graph = load_graph(path)
    edges, _ = edge_weights(graph.edge_index, graph.num_nodes, norm)
    part = partition_nodes(graph.edge_index, graph.num_nodes, parts, method, seed)
    src, dst = edges
    cross = part[src] != part[dst]
    # a partition's halo: the distinct other-partition sources of its in-edges
    pairs = unique_columns(torch.stack([part[dst[cross]], src[cross]]), max(graph.num_nodes, parts))
    return graph.num_nodes, pairs.shape[1]


def comm_analytic(run: Run) -> float:
    """Bytes per epoch by ``estimate_graph``'s formulas (the model's ``GraphCost`` widths), with the
    halo of the actual partition; a hybrid adds both terms."""
    cfg = run.cfg
    spec = get_model_spec(cfg.model.arch)
    model_config = build_config(cfg.model.arch, cfg.model.options)
    model = SimpleNamespace(config=model_config)
    layers, d, w = spec.cost.aggregations(model), spec.cost.history_width(model), spec.cost.stage_width(model)
    stages = cfg.parallel.pp
    parts = run.procs // stages
    nodes, halo = halo_rows(str(cfg.data.train_path), model_config.neighbour_norm, parts,
                            cfg.data.graph_partitioner, cfg.train.seed)
    return 2 * layers * halo * d * 4 + 2 * (stages - 1) * nodes * w * 4


def comm(args: argparse.Namespace) -> int:
    global OUT
    OUT = OUT / "comm"
    shutil.rmtree(OUT, ignore_errors=True)
    epochs = ["--train.max_steps", str(args.epochs), "--train.eval_interval", "0", "--checkpoint.interval", "0"]
    table, failures = [], []
    for layers in args.layers:
        depth = ["--model.num_layers", str(layers), *epochs]
        runs = [Run(f"L{layers}-single", 1, [*depth, "--parallel.pp", "1", "--train.grad_accum", "1"])]
        for n in args.procs:
            runs.append(Run(f"L{layers}-graph-par{n}", n, [*depth, "--parallel.pp", "1", "--train.grad_accum", "1"]))
            runs.append(Run(f"L{layers}-gnnpipe{n}", n, [*depth, "--parallel.pp", str(n), "--train.grad_accum",
                                                          str(args.chunks_per_stage * n), *EXACT_EPOCHS_OFF]))
            if n >= 4 and n % 2 == 0:
                runs.append(Run(f"L{layers}-hybrid{n}", n, [*depth, "--parallel.pp", "2", "--train.grad_accum",
                                                             str(args.chunks_per_stage * 2), *EXACT_EPOCHS_OFF]))
        failures += run_all(runs, args)
        for run in (r for r in runs if r.records):
            try:
                steady(run, args.skip)
            except RunFailed as exc:
                failures.append(str(exc))
                run.records = []
        table += comm_rows(layers, [r for r in runs if r.records], args.skip)
    print(f"\nbytes and time per epoch ({args.recipe}; median of steps {args.skip + 1}-{args.epochs}; "
          f"{os.cpu_count()} CPU cores, {threads_note(args)}; times noisy on a shared machine)\n")
    print("| depth | procs | mode | layout | measured MB/epoch | analytic MB/epoch | measured/analytic "
          "| graph-par / this | epoch s | time / single |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in table:
        print("| " + " | ".join(row) + " |")
    return report_failures(failures)


def comm_rows(layers: int, runs: list[Run], skip: int) -> list[list[str]]:
    by_name = {r.name: r for r in runs}
    single = by_name.get(f"L{layers}-single")
    base_time = epoch_time(single, skip) if single else None
    rows = []
    for run in runs:
        mode, procs = _mode(run.name)
        total, per_kind, constant = measured_bytes(run, skip)
        analytic = comm_analytic(run)
        gp = by_name.get(f"L{layers}-graph-par{procs}")
        gp_ratio = ""
        if gp and mode in ("gnnpipe", "hybrid") and total:
            gp_ratio = f"{measured_bytes(gp, skip)[0] / total:.2f}x"
        seconds = epoch_time(run, skip)
        kinds = " + ".join(f"{k} {v / 1e6:.2f}" for k, v in per_kind.items() if v)
        rows.append([
            str(layers), str(procs), mode,
            f"pp {run.cfg.parallel.pp} x {procs // run.cfg.parallel.pp} part, {run.cfg.train.grad_accum} chunk(s)",
            f"{total / 1e6:.2f}" + (f" ({kinds})" if "+" in kinds else "") + ("" if constant else " (varies)"),
            f"{analytic / 1e6:.2f}",
            f"{total / analytic:.3f}" if analytic else ("exact 0" if not total else "n/a"),
            gp_ratio, f"{seconds:.3f}", f"{seconds / base_time:.2f}" if base_time else "n/a",
        ])
    return rows


def _mode(name: str) -> tuple[str, int]:
    tail = name.split("-", 1)[1]
    for mode in ("graph-par", "gnnpipe", "hybrid"):
        if tail.startswith(mode):
            return mode, int(tail[len(mode):])
    return "single", 1


# ------------------------------------------------------------------------------------ converge

def curve(run: Run) -> list[tuple[int, float, float]]:
    """(epoch, validation accuracy, test accuracy) at each eval (one per epoch: the last one logged)."""
    evals = {r["step"]: (r["step"], r["eval_accuracy"], r["eval_test_accuracy"])
             for r in run.records if "eval_accuracy" in r}
    return [evals[step] for step in sorted(evals)]


def reached(points: list[tuple[int, float, float]], target: float) -> str:
    return next((str(epoch) for epoch, _, test in points if test >= target - WITHIN), "never")


def converge(args: argparse.Namespace) -> int:
    global OUT
    OUT = OUT / "converge"
    shutil.rmtree(OUT, ignore_errors=True)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown --variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.epochs <= 2 or args.eval_every > args.epochs:
        raise SystemExit(f"--epochs {args.epochs} --eval-every {args.eval_every}: need more than 2 epochs (the "
                         "epoch time skips the first 2) and at least one eval")
    base = ["--train.max_steps", str(args.epochs), "--train.eval_interval", str(args.eval_every),
            "--checkpoint.interval", "0"]
    failures, results = [], []
    for seed in args.seeds:
        common = [*base, "--train.seed", str(seed)]
        ref = Run(f"seed{seed}-reference", 1, [*common, "--parallel.pp", "1", "--train.grad_accum", "1"])
        pipes = [Run(f"seed{seed}-gnnpipe-{v}", args.pp,
                     [*common, "--parallel.pp", str(args.pp), "--train.grad_accum", str(args.chunks), *VARIANTS[v]])
                 for v in args.variants]
        failures += run_all([ref, *pipes], args)
        results.append((seed, ref, pipes))
    write_curves(results)
    print(f"\nconvergence ({args.recipe}; {args.epochs} epochs, eval every {args.eval_every}; GNNPipe: pp {args.pp}, "
          f"{args.chunks} chunks; {threads_note(args)}; 'reaches' = first eval within {WITHIN * 100:.0f} point "
          "of the reference's final test accuracy)\n")
    print("| seed | run | final test acc | vs reference (points) | test acc at best val | reaches at epoch "
          "| epoch s |")
    print("|---|---|---|---|---|---|---|")
    gaps: dict[str, list[float]] = {}
    for seed, ref, pipes in results:
        if not curve(ref):
            continue
        target = curve(ref)[-1][2]
        for run in (ref, *pipes):
            points = curve(run)
            if not points:
                continue
            label, final = run.name.split("-", 1)[1], points[-1][2]
            best = max(points, key=lambda p: p[1])
            gaps.setdefault(label, []).append(final - target)
            print(f"| {seed} | {label} | {final * 100:.2f} | {(final - target) * 100:+.2f} "
                  f"| {best[2] * 100:.2f} (epoch {best[0]}) | {reached(points, target)} "
                  f"| {epoch_time(run, 2):.3f} |")
    for label, values in gaps.items():
        if label != "reference":
            print(f"\n{label}: final test accuracy {statistics.mean(values) * 100:+.2f} points vs the reference, "
                  f"mean over {len(values)} seed(s) (worst {min(values) * 100:+.2f})", end="")
    print()
    if (OUT / "converge.png").is_file():
        print(f"\ncurves: {OUT / 'converge.csv'}, {OUT / 'converge.png'}")
    return report_failures(failures)


def write_curves(results: list[tuple[int, Run, list[Run]]]) -> None:
    runs = [run for _, ref, pipes in results for run in (ref, *pipes) if run.records]
    OUT.mkdir(parents=True, exist_ok=True)
    with (OUT / "converge.csv").open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["run", "epoch", "val_accuracy", "test_accuracy"])
        for run in runs:
            out.writerows([run.name, *point] for point in curve(run))
    kinds = list(dict.fromkeys(run.name.split("-", 1)[1] for run in runs))  # one colour per kind of run
    series = [Series(run.name, [p[0] for p in curve(run)], [100 * p[2] for p in curve(run)],
                     color=kinds.index(run.name.split("-", 1)[1])) for run in runs if curve(run)]
    if series:
        line_chart(str(OUT / "converge.png"), "test accuracy per eval", "epoch", "test acc %", series,
                   size=(900, 520))


def threads_note(args: argparse.Namespace) -> str:
    return f"{args.threads} thread(s) per process" if args.threads else "cores / processes threads per process"


def report_failures(failures: list[str]) -> int:
    if not failures:
        return 0
    print(f"\n{len(failures)} run(s) failed:")
    for message in failures:
        print(f"  {message}")
    return 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("comm", help="bytes and time per epoch by mode and depth")
    c.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32])
    c.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    c.add_argument("--epochs", type=int, default=12)
    c.add_argument("--skip", type=int, default=2, help="first steps left out of the medians")
    c.add_argument("--chunks-per-stage", type=int, default=2)
    v = sub.add_parser("converge", help="GNNPipe with staleness vs the single-process reference")
    v.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    v.add_argument("--epochs", type=int, default=200)
    v.add_argument("--eval-every", type=int, default=10)
    v.add_argument("--pp", type=int, default=2)
    v.add_argument("--chunks", type=int, default=4)
    v.add_argument("--variants", nargs="+", default=["recipe"], help=f"of {', '.join(VARIANTS)}")
    for p in (c, v):
        p.add_argument("--recipe", default=RECIPE)
        p.add_argument("--extra", type=shlex.split, default=[], help="overrides for every run, one string")
        p.add_argument("--threads", type=int, default=None,
                       help="OMP_NUM_THREADS of every process (default: train.sh's, cores / processes)")
    args = parser.parse_args()
    sys.exit(comm(args) if args.command == "comm" else converge(args))


if __name__ == "__main__":
    main()
