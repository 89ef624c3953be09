"""Everything the tiny text-to-video recipe reads, each piece built once and reused.

``recipes/goku/tiny_t2v.yaml`` names this script as its ``data.prepare``, so a fresh checkout's
``bash scripts/train.sh recipes/goku/tiny_t2v.yaml`` builds, in order (each step returns at
once when its output is current, and waits for a concurrent builder of the same output):

1. the captioned moving-shapes clips (``data/build_moving_shapes.py``, seconds);
2. stage 0, the small VAE the recipe cannot download: trained with the project's own trainer
   on those clips, exported as a diffusers folder with its latent scaling
   (``data/build_vae.py``, ``recipes/goku/tiny_vae.yaml``, a few minutes on 2 CPU cores);
3. the text encoder and the precomputed latents and text states of every clip
   (``data/build_video_latents.py``, a few minutes), written to ``--train-out`` / ``--eval-out``.

    python data/build_t2v_data.py --train-out data/cache/video/moving_shapes_latents/train \\
        --eval-out data/cache/video/moving_shapes_latents/eval
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VIDEO = REPO / "data" / "cache" / "video"
CLIPS, VAE, TEXT_ENCODER = VIDEO / "moving_shapes", VIDEO / "vae", VIDEO / "text_encoder"


def run(script: str, *args: str | Path) -> None:
    cmd = [sys.executable, str(REPO / "data" / script), *map(str, args)]
    if subprocess.run(cmd).returncode != 0:
        sys.exit(f"[build_t2v_data] failed: {' '.join(cmd)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-out", type=Path, required=True)
    parser.add_argument("--eval-out", type=Path, required=True)
    args = parser.parse_args(argv)
    run("build_moving_shapes.py", "--train-out", CLIPS / "train", "--eval-out", CLIPS / "eval")
    run("build_vae.py", "--out", VAE)
    run("build_video_latents.py", "--clips", CLIPS, "--vae", VAE, "--text-encoder", TEXT_ENCODER,
        "--train-out", args.train_out, "--eval-out", args.eval_out)


if __name__ == "__main__":
    main()
