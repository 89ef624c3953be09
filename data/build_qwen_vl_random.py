"""Build a small Qwen2.5-VL folder with random weights: the starting point of the tiny ``qwen2_5_vl``
recipe (``recipes/qwen2.5-vl/tiny.yaml``), so that recipe starts the way a real run does, from a
whole Hugging Face folder (``checkpoint.init_from_hf``), with no download.

``Qwen2_5_VLForConditionalGeneration`` is built by transformers from a small config (``TEXT``,
``VISION``: a 4-layer windowed tower of width 96 into a 4-layer Qwen2 of width 128 with M-RoPE, rope_theta 10) and
its own random initialisation, and written with ``save_pretrained``. Its vocabulary is the bundled
tokenizer's (``data/tokenizers/stdlib-bpe-8k``, 8,192 tokens) plus Qwen's four vision tokens at the
ids the chat loader adds them (``<|vision_start|>`` 8192, ``<|vision_end|>`` 8193, ``<|image_pad|>``
8194, ``<|video_pad|>`` 8195; ``QwenVLConfig.media_layout``) and four spare rows: 8,200. The recipe
reads text with that tokenizer; a folder of a released model would come with its own.

``manifest.json``, written last, records ``format_version`` and ``seed``; a folder whose manifest
matches is kept. Staged, then renamed, under a lock (concurrent launchers build it once).

    python data/build_qwen_vl_random.py --out data/cache/qwen2_5_vl_tiny_random
"""

from __future__ import annotations

import argparse
import fcntl
import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from veomni.data.builders import MANIFEST, staging_folder  # noqa: E402

FORMAT_VERSION = 2  # 2: rope_theta 10
TOKEN_IDS = dict(vision_start_token_id=8192, vision_end_token_id=8193, image_token_id=8194, video_token_id=8195)
TEXT = dict(vocab_size=8200, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
            bos_token_id=None, eos_token_id=0, pad_token_id=1,  # the bundled tokenizer's
            rope_parameters={"rope_type": "default", "rope_theta": 10.0, "mrope_section": [4, 6, 6]})
# rope_theta 10, not 10000: M-RoPE gives the w (column) block the last, slowest frequency slots; at
# head_dim 32 and theta 10000 they turn by at most 0.003 rad per position, so the LLM cannot tell
# image columns apart (held-out "left or right?" stays at its majority baseline); at theta 10 the
# slowest turns 0.12 rad (docs/qwen_vl.md)
VISION = dict(depth=4, hidden_size=96, intermediate_size=256, num_heads=4, out_hidden_size=128, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1, 3],
              tokens_per_second=2, hidden_act="silu")


def make_model(seed: int) -> Qwen2_5_VLForConditionalGeneration:
    """transformers' own random initialisation of the small model; the same ``seed``, the same weights."""
    config = Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=False, **TOKEN_IDS)
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def is_current(out: Path, seed: int) -> bool:
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (manifest.get("format_version"), manifest.get("seed")) == (FORMAT_VERSION, seed)


def build(out: Path, seed: int = 0) -> None:
    if is_current(out, seed):
        print(f"cached: {out} is complete")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_current(out, seed):
            return
        tmp = staging_folder(out)
        model = make_model(seed)
        model.save_pretrained(tmp)
        count = sum(p.numel() for p in model.parameters())
        (tmp / MANIFEST).write_text(json.dumps({"format_version": FORMAT_VERSION, "seed": seed,
                                                "parameters": count}, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    print(f"{out}: Qwen2.5-VL with random weights ({count:,} parameters, seed {seed})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    build(args.out, args.seed)


if __name__ == "__main__":
    main()
