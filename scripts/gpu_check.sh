#!/usr/bin/env bash
# Check a GPU machine end to end and time the project against transformers and diffusers:
#   bash scripts/gpu_check.sh [--only PART,...] [--tiny] [--out DIR]
# Runs the CUDA-only tests, trains the quick start and a Qwen3-1.7B-shaped decoder through
# train.sh (eager and compiled), and times the video DiT and an MoE against their references;
# prints a table and writes outputs/gpu_check/report.json (docs/performance.md). On a machine
# without network it uses the torch already installed (VEOMNI_TORCH=auto picks a CUDA build) and
# installs missing packages from VEOMNI_WHEELS. Exits non-zero if any part failed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$REPO_ROOT"
exec python scripts/gpu_check.py "$@"
