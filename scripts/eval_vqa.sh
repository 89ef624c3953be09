#!/usr/bin/env bash
# Held-out answer accuracy of a trained VLM run, per question type, next to the majority baseline:
#   bash scripts/eval_vqa.sh OUTPUT_DIR [--checkpoint STEP_DIR] [--split eval|train] [--limit N]
#                             [--max-answer-tokens N]   (answers are decoded up to N tokens; default 8)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec python -m veomni.eval.vqa "$@"
