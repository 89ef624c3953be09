#!/usr/bin/env bash
# The quick start with Muon against AdamW, a learning-rate sweep each (table, see scripts/muon_sweep.py):
#   bash scripts/muon_sweep.sh [--out DIR] [--lrs LR ...] [--adamw-lrs LR ...] [--muon-lrs LR ...] [--max-steps N] [--summarise-only]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$REPO_ROOT"
exec python scripts/muon_sweep.py "$@"
