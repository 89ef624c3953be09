#!/usr/bin/env bash
# Export a checkpoint to a Hugging Face folder:
#   bash scripts/export_hf.sh OUTPUT_DIR/checkpoints/step_00001000 EXPORT_DIR [--config RUN/config.yaml]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec python -m veomni.checkpoint.export "$@"
