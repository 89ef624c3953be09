"""The step-time cost of Muon's orthogonalisation: the quick-start model (recipes/quickstart/
tiny_llm.yaml, one process), one training step (forward, backward, optimizer) with AdamW and with
Muon in the same job, alternated so load drifts hit both alike; prints the median times, the
optimizer step alone, and the ratio Muon / AdamW.

    python scripts/bench_muon.py [--steps 6] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import models  # noqa: F401  (registers the zoo)
from veomni.config.load import load_config
from veomni.contract import build_model
from veomni.optim import build_optimizer

REPO = Path(__file__).resolve().parents[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    cfg = load_config(REPO / "recipes/quickstart/tiny_llm.yaml")
    tokens = cfg.data.tokens_per_micro_batch
    runs = {}
    for name in ("adamw", "muon"):
        torch.manual_seed(0)
        _, model = build_model(cfg.model.arch, cfg.model.options)
        model.init_weights()
        model.to(device)
        cfg.train.optimizer = name
        runs[name] = (model, build_optimizer(model, cfg.train, optim=cfg.optim))
    ids = torch.randint(0, cfg.model.options["vocab_size"], (tokens,), device=device)
    positions = torch.arange(tokens, device=device) % cfg.data.max_seq_len
    cu = torch.arange(0, tokens + 1, cfg.data.max_seq_len, dtype=torch.int32, device=device)
    times = {name: {"step": [], "optimizer": []} for name in runs}
    for index in range(args.steps + 2):  # the first two warm up
        for name, (model, optimizer) in runs.items():
            _sync(device)
            start = time.perf_counter()
            logits = model(ids, positions, cu, cfg.data.max_seq_len)
            logits.float().logsumexp(-1).mean().backward()
            _sync(device)
            mid = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            end = time.perf_counter()
            if index >= 2:
                times[name]["step"].append(end - start)
                times[name]["optimizer"].append(end - mid)
    med = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    print(f"device {device}, {tokens} tokens per step, median of {args.steps} steps")
    for name, m in med.items():
        print(f"  {name:6s} step {m['step'] * 1e3:8.1f} ms   optimizer {m['optimizer'] * 1e3:8.1f} ms")
    print(f"  muon / adamw: step {med['muon']['step'] / med['adamw']['step']:.2f}x, "
          f"optimizer {med['muon']['optimizer'] / med['adamw']['optimizer']:.2f}x")


if __name__ == "__main__":
    main()
