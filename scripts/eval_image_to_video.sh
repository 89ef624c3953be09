#!/usr/bin/env bash
# Image-to-video on held-out moving shapes (first frame + caption) against a text-to-video run and
# a copied-frame baseline: first-frame PSNR, later-frame PSNR, centroid error, direction read.
#   bash scripts/eval_image_to_video.sh outputs/tiny_i2v outputs/tiny_t2v [--limit 64] [--steps 30]
#        [--guidance 4] [--seed 0] [--no-ema] [--out DIR]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec python "$REPO_ROOT/scripts/eval_image_to_video.py" "$@"
