#!/usr/bin/env bash
# Run the whole test suite (or pass pytest arguments):  bash scripts/test.sh [pytest args]
# Exits non-zero on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$REPO_ROOT"
export WANDB_MODE="${WANDB_MODE:-disabled}"
exec python -m pytest "$@"
