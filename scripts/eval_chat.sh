#!/usr/bin/env bash
# Held-out exact-match accuracy of a chat run's greedy answers, next to the echo and majority baselines
# (a preference run: against each pair's chosen and rejected reply, beside the model it started from):
#   bash scripts/eval_chat.sh OUTPUT_DIR [--checkpoint STEP_DIR] [--split eval|train] [--limit N]
#                             [--max-answer-tokens N] [--json FILE]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec python -m veomni.eval.chat_exact_match "$@"
