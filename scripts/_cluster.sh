# Sourced by scripts/train.sh: where this node sits in a multi-node run, read from what the
# cluster already says, so one command line works on a laptop, under Slurm and on Kubernetes.
#
# Sets NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, RDZV_ID (the run's id: torchrun's
# TORCHELASTIC_RUN_ID, which tells this run's checkpoints from older ones in the same output_dir),
# NPROC_PER_NODE when the cluster says how many GPUs this node has, and LAYOUT_FROM (a line for
# the log, "" when nothing was detected). Sources, first match wins, each variable set by the user
# winning over the detected one:
#   1. NNODES set by the user: NODE_RANK, MASTER_ADDR, MASTER_PORT, RDZV_ID as given.
#   2. Slurm, when run by srun with one task per node (scripts/sbatch_example.sh): node count
#      and node id of the step, the first host of its node list as master (scontrol when present,
#      else the first name of the compressed list, "node[01-04,07]" -> node01), a port derived
#      from the job id (15000 + its last 4 digits, as PyTorch Lightning's SLURMEnvironment does),
#      the job id as RDZV_ID and SLURM_GPUS_ON_NODE as processes per node.
#   3. Kubeflow: PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR/PORT and PET_NPROC_PER_NODE, the
#      torchrun variables the Kubeflow Trainer (TrainJob) sets, and which the training-operator
#      sets for a PyTorchJob next to MASTER_ADDR/MASTER_PORT (kubeflow/training-operator,
#      pkg/controller.v1/pytorch/envvar.go). The operator's WORLD_SIZE and RANK are not read:
#      its WORLD_SIZE counts processes (replicas x nprocPerNode), not nodes. RDZV_ID: PET_RDZV_ID
#      (an elastic PyTorchJob), else the master's address, which holds the job's name.
#   Otherwise one node; a multi-node run with no RDZV_ID gets "veomni-$MASTER_PORT".

_cluster_fail() {
    echo "[train.sh] $1" >&2
    exit 2
}

# First host of a Slurm node list: "node[01-04,07],gpu5" -> node01.
_slurm_first_host() {
    if command -v scontrol >/dev/null 2>&1; then
        scontrol show hostnames "$1" | sed -n 1p
    else
        printf '%s\n' "$1" | sed -E 's/\[([0-9]+)[^]]*\]/\1/g; s/,.*//'
    fi
}

_layout_from_slurm() {
    NNODES="${SLURM_STEP_NUM_NODES:-${SLURM_NNODES:-$SLURM_JOB_NUM_NODES}}"
    if [ "$NNODES" -gt 1 ] && [ -z "${SLURM_STEP_ID:-}" ]; then
        _cluster_fail "Slurm allocated $NNODES nodes but train.sh is not running under srun, so only this node would start and wait for the others: start it once per node with 'srun --ntasks-per-node=1 bash scripts/train.sh ...' (see scripts/sbatch_example.sh), or set NNODES=1 to train on this node alone"
    fi
    local tasks="${SLURM_STEP_NUM_TASKS:-$NNODES}"
    if [ "$tasks" != "$NNODES" ]; then
        _cluster_fail "srun started $tasks tasks on $NNODES nodes; train.sh must run once per node (it starts one process per GPU itself): use srun --ntasks-per-node=1"
    fi
    NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
    local nodelist="${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-}}"
    [ -n "$nodelist" ] || _cluster_fail "Slurm gives no node list (SLURM_JOB_NODELIST): set MASTER_ADDR to the first node's address"
    MASTER_ADDR="${MASTER_ADDR:-$(_slurm_first_host "$nodelist")}"
    MASTER_PORT="${MASTER_PORT:-$((15000 + 10#$SLURM_JOB_ID % 10000))}"
    RDZV_ID="${RDZV_ID:-slurm-$SLURM_JOB_ID}"
    if [ -n "${SLURM_GPUS_ON_NODE:-}" ] && [ "$SLURM_GPUS_ON_NODE" -gt 0 ]; then
        NPROC_PER_NODE="${NPROC_PER_NODE:-$SLURM_GPUS_ON_NODE}"
    fi
    LAYOUT_FROM="Slurm"
}

_layout_from_kubeflow() {
    case "$PET_NNODES" in
        *:*) _cluster_fail "PET_NNODES=$PET_NNODES is an elastic range; train.sh runs a fixed number of nodes: drop the job's elasticPolicy, or set NNODES" ;;
    esac
    NNODES="$PET_NNODES"
    NODE_RANK="${NODE_RANK:-${PET_NODE_RANK:-0}}"
    MASTER_ADDR="${MASTER_ADDR:-${PET_MASTER_ADDR:-}}"
    MASTER_PORT="${MASTER_PORT:-${PET_MASTER_PORT:-}}"
    [ -n "$MASTER_ADDR" ] || _cluster_fail "PET_NNODES=$NNODES but neither MASTER_ADDR nor PET_MASTER_ADDR is set: set MASTER_ADDR to node 0's address"
    RDZV_ID="${RDZV_ID:-${PET_RDZV_ID:-veomni-$MASTER_ADDR}}"
    case "${PET_NPROC_PER_NODE:-}" in
        '' | auto | *[!0-9]*) ;;
        *) NPROC_PER_NODE="${NPROC_PER_NODE:-$PET_NPROC_PER_NODE}" ;;
    esac
    LAYOUT_FROM="Kubeflow (PET_*)"
}

LAYOUT_FROM=""
if [ -n "${NNODES:-}" ]; then
    LAYOUT_FROM="NNODES/NODE_RANK"
elif [ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_STEP_NUM_NODES:-${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-}}}" ]; then
    _layout_from_slurm
elif [ -n "${PET_NNODES:-}" ]; then
    _layout_from_kubeflow
fi
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
RDZV_ID="${RDZV_ID:-veomni-$MASTER_PORT}"
if ! [ "$NODE_RANK" -ge 0 ] 2>/dev/null || ! [ "$NODE_RANK" -lt "$NNODES" ] 2>/dev/null; then
    _cluster_fail "NODE_RANK=$NODE_RANK must be a number from 0 to NNODES-1 (NNODES=$NNODES)"
fi
