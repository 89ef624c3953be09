"""Video DiT on this machine: MFU against the LLM quick start, and activation memory per latent token.

    python scripts/bench_dit.py mfu [--steps 30]        # both quick starts, alternately, in one job
    python scripts/bench_dit.py memory [--tokens 2048]  # saved-for-backward bytes per token, sp=1 vs sp=2

``mfu`` trains ``recipes/quickstart/tiny_llm.yaml`` and ``recipes/goku/tiny_t2v.yaml`` for
``--steps`` steps each through the real launcher (2 gloo processes, one thread each, no eval,
no checkpoint, no samples), twice, alternating, and prints each run's median MFU over its steps
after the fifth (both divide model FLOPs by the same measured CPU matmul peak) and DiT / LLM.

``memory`` runs one forward of the tiny text-to-video DiT on a packed row of ``--tokens`` latent
tokens (clips of the bundled data's sizes) under ``sp`` = 1 and 2 gloo processes and counts the
bytes of every activation autograd saves for backward (tensors along the row: a rank's tokens,
or inside Ulysses all tokens of its heads; each storage once): what a rank must hold
per latent token it owns, independent of allocator and device. Ulysses keeps each rank's
activations to its own tokens, so the figure per token should not grow with sp.

Take figures on a quiet machine: nothing else on its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from veomni.config.load import load_config  # noqa: E402
from veomni.config.schema import ParallelConfig  # noqa: E402
from veomni.contract import build_model, get_model_spec, load_plugins  # noqa: E402
from veomni.ops.video_patch import grid_positions, patchify  # noqa: E402
from veomni.parallel.apply import parallelize  # noqa: E402
from veomni.parallel.mesh import ParallelDims, build_mesh  # noqa: E402
from veomni.parallel.row_split import RowSplit, shard_batch  # noqa: E402

DIT_RECIPE = REPO / "recipes" / "goku" / "tiny_t2v.yaml"
LLM_RECIPE = REPO / "recipes" / "quickstart" / "tiny_llm.yaml"
OUT = REPO / "outputs" / "bench_dit"


def _train(recipe: Path, steps: int, out: Path) -> float:
    """Median MFU of one short run after its first 5 steps."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "veomni.launch", str(recipe)], check=True, env=env,
                   stdout=subprocess.DEVNULL)  # data built once (a no-op when cached)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "veomni.train.run", str(recipe),
           "--train.max_steps", str(steps), "--train.output_dir", str(out), "--train.eval_interval", "0",
           "--data.eval_path", "null", "--checkpoint.interval", "0", "--checkpoint.save_final", "false",
           "--checkpoint.resume", "none", "--log.progress_bar", "false", "--train.sample_interval", "0",
           "--train.sample_prompt", "null"]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["mfu"] for r in records if "mfu" in r and r["step"] > 5)


def bench_mfu(steps: int, rounds: int) -> None:
    import shutil

    shutil.rmtree(OUT / "mfu", ignore_errors=True)
    results: dict[str, list[float]] = {"llm": [], "dit": []}
    for round_ in range(rounds):
        order = [("llm", LLM_RECIPE), ("dit", DIT_RECIPE)]
        for name, recipe in order if round_ % 2 == 0 else order[::-1]:
            mfu = _train(recipe, steps, OUT / "mfu" / f"{name}_{round_}")
            results[name].append(mfu)
            print(f"round {round_}  {name:<4} MFU {mfu:.2%}", flush=True)
    llm, dit = statistics.median(results["llm"]), statistics.median(results["dit"])
    print(f"median MFU  LLM quick start {llm:.2%}   DiT tiny_t2v {dit:.2%}   DiT / LLM = {dit / llm:.2f}")


def _row(tokens: int, model_cfg) -> dict:
    """A packed row of about ``tokens`` latent tokens: 9-frame clips of 12x12 latents, random."""
    patch = tuple(model_cfg.patch_size)
    gen = torch.Generator().manual_seed(0)
    rows, total = [], 0
    while total < tokens:
        latent = torch.randn(model_cfg.in_channels, 9, 12, 12, generator=gen)
        rows.append(patchify(latent, patch))
        total += len(rows[-1])
    grid = (9 // patch[0], 12 // patch[1], 12 // patch[2])
    lengths = torch.tensor([len(r) for r in rows])
    text = torch.randn(6 * len(rows), model_cfg.text_dim, generator=gen)
    latents = torch.cat(rows)
    return {"latents": latents, "noisy": latents, "target": latents,
            "clean": torch.zeros(len(latents), dtype=torch.bool),
            "positions": torch.cat([grid_positions(grid) for _ in rows]),
            "sample_index": torch.repeat_interleave(torch.arange(len(rows)), lengths),
            "cu_seqlens": torch.cat([torch.zeros(1), lengths.cumsum(0)]).to(torch.int32),
            "max_seqlen": int(lengths.max()), "grid": torch.tensor([grid] * len(rows)),
            "timesteps": torch.rand(len(rows), generator=gen) * 1000, "text_states": text,
            "text_cu_seqlens": torch.arange(0, 6 * len(rows) + 1, 6, dtype=torch.int32)}


def _memory_worker(rank: int, sp: int, tokens: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(sp))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=sp)
    load_plugins()
    cfg = load_config(DIT_RECIPE)
    torch.manual_seed(0)
    model_cfg, model = build_model("dit", cfg.model.options)
    model.init_weights()
    parallel = ParallelConfig(sp=sp)
    model = parallelize(model, parallel, build_mesh(ParallelDims.resolve(parallel, sp), "cpu"), "cpu")
    task = get_model_spec("dit").task(model_cfg)
    batch = shard_batch(_row(tokens, model_cfg), RowSplit(sp_rank=rank, sp=sp), task.contract)
    local_rows = len(batch["sample_index"])
    rows = {local_rows, local_rows * sp}  # a rank's tokens, or (inside Ulysses) all tokens of its heads
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 1 and t.shape[0] in rows and not hasattr(t, "to_local"):  # activations, not weights
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = task(model, batch).loss_sum
    local = int((batch["sample_index"] >= 0).sum())
    saved = sum(seen.values())
    loss.backward()
    queue.put((rank, saved / local, local))
    dist.destroy_process_group()


def bench_memory(tokens: int) -> None:
    ctx = mp.get_context("spawn")
    per_token = {}
    for sp in (1, 2):
        queue = ctx.Queue()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        procs = [ctx.Process(target=_memory_worker, args=(r, sp, tokens, port, queue)) for r in range(sp)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=300) for _ in procs]
        for p in procs:
            p.join()
        per_token[sp] = max(r[1] for r in results)
        print(f"sp={sp}: {per_token[sp] / 1024:.1f} KiB saved for backward per latent token "
              f"(tokens per rank {', '.join(str(r[2]) for r in sorted(results))})", flush=True)
    print(f"sp=2 / sp=1 per token: {per_token[2] / per_token[1]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    mfu = sub.add_parser("mfu")
    mfu.add_argument("--steps", type=int, default=30)
    mfu.add_argument("--rounds", type=int, default=2)
    memory = sub.add_parser("memory")
    memory.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    if args.command == "mfu":
        bench_mfu(args.steps, args.rounds)
    else:
        bench_memory(args.tokens)


if __name__ == "__main__":
    main()
