#!/usr/bin/env bash
# Prompt following of a trained video DiT on the held-out moving-shapes captions (per-attribute accuracy
# next to shuffled captions and the ground-truth clips; scores.json + a contact sheet):
#   bash scripts/eval_prompt_following.sh RUN_DIR [--limit 48] [--clips data/cache/video/moving_shapes]
#        [--steps 30] [--guidance 4] [--seed 0] [--checkpoint STEP_DIR] [--no-ema] [--out DIR]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec python "$REPO_ROOT/scripts/eval_prompt_following.py" "$@"
