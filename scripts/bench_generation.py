"""Generation benchmark (a script, not a test): the KV cache against re-running every prefix, in
one job, on the same model, prompts and device; with ``--group G``, G continuations per prompt
sharing one prefill (``SamplingParams.n``, an RL group) against the prompt repeated G times.

    source scripts/_venv.sh && python scripts/bench_generation.py [--batch 16 --prompt-len 128
        --new-tokens 128 --hidden 512 --layers 8 --device cpu|cuda --dtype float32|bfloat16 --group 1]

Both runs decode with ``veomni.generation.generate`` (greedy; with a group, sampled at temperature
1 from one seed) and must give the same tokens; it prints each one's generated tokens per second
and their ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veomni.contract import build_model, load_plugins  # noqa: E402
from veomni.generation import SamplingParams, generate  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--group", type=int, default=1,
                        help="continuations per prompt: > 1 times a shared prefill against repeated prompts")
    args = parser.parse_args(argv)
    load_plugins()
    torch.manual_seed(0)
    heads = args.hidden // 64
    _, model = build_model("llm", dict(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                                       intermediate_size=args.hidden * 3, num_heads=heads,
                                       num_kv_heads=max(1, heads // 4), head_dim=64, family="qwen3", qk_norm=True,
                                       max_position_embeddings=args.prompt_len + args.new_tokens, init_std=0.2))
    model.init_weights()
    model.to(args.device, getattr(torch, args.dtype)).eval()
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.batch,), generator=gen).tolist()
    prompts = [torch.randint(0, args.vocab, (n,), generator=gen).tolist() for n in lengths]
    print(f"{args.layers} layers x {args.hidden} wide, vocab {args.vocab}, {args.dtype} on {args.device}; "
          f"{args.batch} prompts of {min(lengths)}-{max(lengths)} tokens, {args.new_tokens} new tokens each"
          + (f", {args.group} per prompt" if args.group > 1 else ""))
    if args.group > 1:
        sampled = dict(max_new_tokens=args.new_tokens, temperature=1.0, seed=0)
        repeated = [prompt for prompt in prompts for _ in range(args.group)]
        runs = {"one prefill per group": lambda: generate(model, prompts, SamplingParams(**sampled, n=args.group)),
                "each prompt repeated": lambda: generate(model, repeated, SamplingParams(**sampled))}
    else:
        params = SamplingParams(max_new_tokens=args.new_tokens)
        runs = {"with KV cache": lambda: generate(model, prompts, params),
                "without KV cache": lambda: generate(model, prompts, params, use_cache=False)}
    generate(model, prompts[:2], SamplingParams(max_new_tokens=2))  # warm-up
    results = {}
    for name, run in runs.items():
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        done = run()
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = sum(len(c.tokens) for c in done)
        results[name] = (seconds, [c.tokens for c in done])
        print(f"{name + ':':<24}{seconds:8.2f} s, {tokens / seconds:10.1f} tokens/s")
    (fast, (fast_s, fast_tokens)), (slow, (slow_s, slow_tokens)) = results.items()
    if fast_tokens != slow_tokens:
        print("the two runs generated different tokens")
        return 1
    print(f"same tokens; {fast} is {slow_s / fast_s:.1f}x faster than {slow}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
