#!/usr/bin/env bash
# Sample clips for prompts with a trained video DiT (one GIF per prompt + a contact sheet):
#   bash scripts/sample.sh RUN_DIR --prompt "a red circle moves left" [--prompt ...] [--steps 30]
#        [--guidance 4] [--seed 0] [--frames 9] [--height 32] [--width 32] [--out DIR]
#        [--checkpoint STEP_DIR] [--no-ema] [--device cpu|cuda]
#        [--image FRAME.png]   image-to-video: the clips start from that frame (a model trained with
#                              model.first_frame_probability > 0, or a Wan2.1 I2V model, in_channels >
#                              out_channels, which needs it; the image's size is the clip's)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec python "$REPO_ROOT/scripts/sample.py" "$@"
