#!/usr/bin/env bash
# The quick start with Muon against AdamW, a learning-rate sweep each (table, see scripts/muon_sweep.py):
#   bash scripts/muon_sweep.sh [--out DIR] [--lrs 2e-3 6e-3 2e-2 6e-2] [--max-steps N] [--summarise-only]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$REPO_ROOT"
exec python scripts/muon_sweep.py "$@"
