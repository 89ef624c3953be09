#!/usr/bin/env bash
# The small-scale VWN sweep in one command (table + plots, see scripts/vwn_sweep.py):
#   bash scripts/vwn_sweep.sh [--out DIR] [--only baseline r2 ...] [--max-steps N]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$REPO_ROOT"
exec python scripts/vwn_sweep.py "$@"
