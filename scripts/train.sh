#!/usr/bin/env bash
# Train from a recipe:  bash scripts/train.sh RECIPE.yaml [--dry-run] [--section.key VALUE ...]
#
# Creates/reuses .venv, validates the recipe (and prepares bundled data) before any worker
# starts, then launches one process per GPU (NCCL), or NPROC_PER_NODE processes (default 2)
# on CPU (gloo). Multi-node: under Slurm (srun, one task per node) or Kubeflow the layout is
# read from the cluster; elsewhere set NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT on every node.
# --dry-run prints the resolved config, layout, parameter count, FLOPs/token and memory per
# rank, then exits; add --world-size N (and --gpus) to plan for a cluster you are not on.
set -euo pipefail
if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
RECIPE="$1"; shift

GPUS=0
if command -v nvidia-smi >/dev/null 2>&1; then
    GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
if [ "$GPUS" -gt 0 ]; then DEFAULT_NPROC=$GPUS; else DEFAULT_NPROC=2; fi
source "$(dirname "${BASH_SOURCE[0]}")/_cluster.sh"  # NNODES, NODE_RANK, MASTER_*, RDZV_ID: user, Slurm, Kubeflow
NPROC_PER_NODE="${NPROC_PER_NODE:-$DEFAULT_NPROC}"
WORLD=$((NNODES * NPROC_PER_NODE))
GPU_FLAG=()
[ "$GPUS" -gt 0 ] && GPU_FLAG=(--gpus)

DRY_RUN=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && DRY_RUN=1; done

SETTINGS=$(mktemp); STOP_FILE=$(mktemp)
trap 'rm -f "$SETTINGS" "$STOP_FILE"' EXIT
python -m veomni.launch "$RECIPE" --launcher-world-size "$WORLD" --launch-settings "$SETTINGS" \
    "${GPU_FLAG[@]}" "$@"
[ "$DRY_RUN" = 1 ] && exit 0
source "$SETTINGS"  # MAX_RESTARTS (train.max_restarts)

echo "[train.sh] $NNODES node(s) x $NPROC_PER_NODE process(es), $([ "$GPUS" -gt 0 ] && echo "GPU/NCCL" || echo "CPU/gloo")" >&2
if [ "$NNODES" = 1 ]; then
    [ -n "$LAYOUT_FROM" ] && echo "[train.sh] layout from $LAYOUT_FROM: 1 node" >&2
    RDZV=(--standalone)
else
    [ -n "$LAYOUT_FROM" ] && echo "[train.sh] layout from $LAYOUT_FROM: $NNODES nodes, this is node $NODE_RANK," \
        "master $MASTER_ADDR:$MASTER_PORT, run id $RDZV_ID" >&2
    RDZV=(--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RDZV_ID"
          --node-rank="$NODE_RANK")
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NPROC_PER_NODE > 0 ? $(nproc) / NPROC_PER_NODE : 1 ))}"
# A worker that dies (or fails fast on a stuck collective) restarts the whole group, which
# resumes from the newest verified checkpoint. A stop a restart cannot fix (veomni.train.fault.stop)
# exits the workers with 0 and leaves its message in VEOMNI_STOP_FILE.
export VEOMNI_STOP_FILE="$STOP_FILE"
# A requested stop (Ctrl-C, or SIGTERM to this script): torchrun runs in its own session, so the
# signal reaches this script only, which passes it to the workers as SIGTERM. They finish the step,
# checkpoint, print how to resume and the summary, and exit 0; torchrun and this script with them.
# A signal to torchrun itself (a scheduler signalling the whole job) reaches the workers through
# its agent the same way; veomni.torchrun then ends with one line, no traceback, and status
# 128 + the signal's number.
REQUESTED_STOP=0
stop_workers() {
    REQUESTED_STOP=1
    echo "[train.sh] stop requested: the workers finish their step, checkpoint and summarise" >&2
    for worker in $(ps -o pid= --ppid "$TORCHRUN"); do kill -TERM "$worker" 2>/dev/null || true; done
}
setsid python -m veomni.torchrun --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" --max-restarts="$MAX_RESTARTS" \
    "${RDZV[@]}" -m veomni.train.run "$RECIPE" "$@" &
TORCHRUN=$!
trap stop_workers INT TERM
status=0
wait "$TORCHRUN" || status=$?
while kill -0 "$TORCHRUN" 2>/dev/null; do  # a trapped signal ended the wait, not torchrun
    status=0
    wait "$TORCHRUN" || status=$?
done
trap - INT TERM
if [ "$REQUESTED_STOP" = 1 ] && [ "$status" = 0 ]; then
    echo "[train.sh] stopped as requested (exit status 0); the command above resumes the run" >&2
fi
if [ -s "$STOP_FILE" ]; then
    echo "[train.sh] run stopped: $(cat "$STOP_FILE")" >&2
    exit 1
fi
exit "$status"
