"""LoRA against full fine-tuning on the same model (a script, not a test): step time and the
memory the training state takes, measured in one process on the same batches.

    source scripts/_venv.sh && python scripts/bench_lora.py [--hidden 512 --layers 8 --rank 16 --tokens 2048]

Each variant builds the same seeded Qwen3-style model, runs ``--warmup`` then ``--steps`` optimizer
steps (forward, backward, AdamW) on packed rows of ``--tokens`` tokens, and reports the median step
time and the bytes of parameters + gradients + optimizer state after the last step (on a GPU also
the peak allocated memory). Ratios are LoRA / full, measured in the same job.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veomni.adapters.lora import add_lora, init_lora, trainable_counts  # noqa: E402
from veomni.config.schema import LoraConfig  # noqa: E402
from veomni.contract import build_model, load_plugins  # noqa: E402


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() * p.element_size() for p in params)
    total += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    total += sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
                 if torch.is_tensor(t) and t.ndim > 0)
    return total


def run(args, rank: int, device: torch.device) -> dict[str, float]:
    torch.manual_seed(0)
    options = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                   num_layers=args.layers, num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 128),
                   head_dim=64, family="qwen3", qk_norm=True, max_position_embeddings=args.tokens)
    _, model = build_model("llm", options)
    model.init_weights()
    if rank:
        add_lora(model, LoraConfig(rank=rank, alpha=2.0 * rank))
        init_lora(model)
    model.to(device)
    trainable, total = trainable_counts(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.tokens + 1,), generator=gen).to(device)
    lengths = [args.tokens // 4] * 4
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    pos = torch.cat([torch.arange(n) for n in lengths]).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        logits = model(ids[:-1], pos, cu, max(lengths))
        loss = torch.nn.functional.cross_entropy(logits.float(), ids[1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"step_s": statistics.median(times), "state_gib": _state_bytes(model, optimizer) / 2**30,
            "trainable": trainable, "total": total, "peak_gib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    load_plugins(["models"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    full, lora = run(args, 0, device), run(args, args.rank, device)
    print(f"# LoRA rank {args.rank} vs full fine-tuning, {device.type}, {full['total']:,} parameters, "
          f"{args.tokens} tokens/step, median of {args.steps} steps")
    print(f"{'':<28}{'full':>12}{'LoRA':>12}{'LoRA/full':>11}")
    rows = [("trainable parameters", full["trainable"], lora["trainable"], "{:>12,}"),
            ("step time (s)", full["step_s"], lora["step_s"], "{:>12.4f}"),
            ("params+grads+optim (GiB)", full["state_gib"], lora["state_gib"], "{:>12.4f}"),
            ("peak allocated (GiB)", full["peak_gib"], lora["peak_gib"], "{:>12.4f}")]
    for name, a, b, fmt in rows:
        ratio = b / a if a == a and a else float("nan")
        print(f"{name:<28}{fmt.format(a)}{fmt.format(b)}{ratio:>11.3f}")


if __name__ == "__main__":
    main()
