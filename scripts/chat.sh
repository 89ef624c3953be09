#!/usr/bin/env bash
# Talk to a trained run (its newest checkpoint, EMA weights where kept), one line per turn:
#   bash scripts/chat.sh OUTPUT_DIR [--checkpoint STEP_DIR] [--max-new-tokens N] [--temperature T]
#                        [--top-p P] [--top-k K] [--seed S] [--image FILE] [--system TEXT]
# "/reset" starts a new conversation; an empty line or end of input ends the chat.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec python "$REPO_ROOT/scripts/chat.py" "$@"
