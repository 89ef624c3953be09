"""Per-block costs a CPU can count, ours against the reference model with the same weights, at a
real model's widths: bytes saved for backward per token and aten ops (forward + backward), with
the ops that differ. Counts, not timings: they do not depend on the machine's load.

    python scripts/profile_cpu.py dit     # Wan2.1-T2V-1.3B widths vs diffusers WanTransformer3DModel
    python scripts/profile_cpu.py llm     # Qwen3-1.7B widths (vocabulary cut to 1,024) vs transformers

Rows are short (a 16x2x16x16 latent: 128 tokens and 8 caption states; 256 text tokens) so two
copies of two blocks fit a laptop; a block's cost is the 2-block model's minus the 1-block one's.
What the figures mean and what they left for a GPU: docs/performance.md.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.perf_models import block_costs, qwen3_pair, wan_pair  # noqa: E402
from models.dit.config import DiTConfig  # noqa: E402

WAN_1_3B = DiTConfig(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                     out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960)
PAIRS = {
    "dit": functools.partial(wan_pair, cfg=WAN_1_3B, latent=(2, 16, 16), text_tokens=8),
    "llm": functools.partial(qwen3_pair, hidden=2048, heads=16, kv_heads=8, head_dim=128, intermediate=6144,
                             vocab=1024, tokens=256),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=sorted(PAIRS))
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="bf16 shows the casts a GPU run makes (slow on most CPUs)")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    costs = block_costs(functools.partial(PAIRS[args.family], dtype=dtype))
    (ours_saved, ref_saved), (ours_ops, ref_ops) = costs.saved_per_token, costs.ops
    print(f"saved for backward per token per block: ours {ours_saved:,.0f} B, reference {ref_saved:,.0f} B "
          f"({ours_saved / ref_saved:.3f}x)")
    print(f"aten ops per block (forward + backward): ours {sum(ours_ops.values())}, reference "
          f"{sum(ref_ops.values())} ({sum(ours_ops.values()) / sum(ref_ops.values()):.3f}x)")
    print("only ours:", dict(sorted((ours_ops - ref_ops).items())))
    print("only the reference:", dict(sorted((ref_ops - ours_ops).items())))
    print("dtype casts (aten._to_copy): ours", ours_ops["aten._to_copy"], "reference", ref_ops["aten._to_copy"])


if __name__ == "__main__":
    main()
