"""Generation benchmark (a script, not a test): the KV cache against re-running every prefix, in
one job, on the same model, prompts and device.

    source scripts/_venv.sh && python scripts/bench_generation.py [--batch 16 --prompt-len 128
        --new-tokens 128 --hidden 512 --layers 8 --device cpu|cuda --dtype float32|bfloat16]

Both runs decode greedily with ``veomni.generation.generate`` (``use_cache=True`` / ``False``) and
must give the same tokens; it prints each one's generated tokens per second and their ratio.
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
    params = SamplingParams(max_new_tokens=args.new_tokens)
    print(f"{args.layers} layers x {args.hidden} wide, vocab {args.vocab}, {args.dtype} on {args.device}; "
          f"{args.batch} prompts of {min(lengths)}-{max(lengths)} tokens, {args.new_tokens} new tokens each")
    results = {}
    for use_cache in (True, False):
        generate(model, prompts[:2], SamplingParams(max_new_tokens=2), use_cache=use_cache)  # warm-up
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        done = generate(model, prompts, params, use_cache=use_cache)
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = sum(len(c.tokens) for c in done)
        results[use_cache] = (seconds, [c.tokens for c in done])
        print(f"{'with' if use_cache else 'without'} KV cache: {seconds:8.2f} s, {tokens / seconds:10.1f} tokens/s")
    if results[True][1] != results[False][1]:
        print("the two runs generated different tokens")
        return 1
    print(f"same tokens; the cache is {results[False][0] / results[True][0]:.1f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
