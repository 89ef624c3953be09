#!/usr/bin/env bash
# Lint, then run the whole test suite (or pass pytest arguments):  bash scripts/test.sh [--fast] [pytest args]
#   --fast   the fast tier only (unit and parity tests, a few minutes): leaves out tests marked `full`
# Exits non-zero on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$REPO_ROOT"
export WANDB_MODE="${WANDB_MODE:-disabled}"
# A skip of anything but a GPU-only (cuda-marked) test fails the run (tests/conftest.py); 0 only lists them.
export VEOMNI_STRICT_SKIPS="${VEOMNI_STRICT_SKIPS:-1}"
# Lint first (the rules are pyproject.toml's [tool.ruff.lint]); a finding fails the suite.
python -m ruff check . || { echo "ruff check failed: fix the findings above ('ruff check --fix .' fixes some)" >&2; exit 1; }
if [ "${1:-}" = "--fast" ]; then
    shift
    exec python -m pytest -m "not full" "$@"
fi
exec python -m pytest "$@"
