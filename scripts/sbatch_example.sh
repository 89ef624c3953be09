#!/usr/bin/env bash
# Train on a Slurm cluster: 2 nodes x 8 GPUs, one train.sh per node.
#
#   sbatch scripts/sbatch_example.sh RECIPE.yaml [--section.key VALUE ...]
#
# Submit from the repository checkout, which every node must see, as must train.output_dir
# (checkpoints need a filesystem shared by all nodes; the run checks it at start-up). train.sh
# reads the layout from Slurm: the node count, this node's rank, the first node as master, a
# port from the job id (set MASTER_PORT to choose one), slurm-$SLURM_JOB_ID as the run id and
# one process per GPU. Copy this file and adjust the #SBATCH lines to your cluster.
#SBATCH --job-name=veomni
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --output=slurm-%j.out
# --ntasks-per-node=1: train.sh starts the processes of its node itself (torchrun).
# --cpus-per-task: the node's cores for that one task (Slurm gives a task 1 core by default);
#   the data loader workers and OMP threads of all 8 processes share them.
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: sbatch scripts/sbatch_example.sh RECIPE.yaml [--section.key VALUE ...]" >&2
    exit 2
fi
cd "${SLURM_SUBMIT_DIR:-.}"
# --kill-on-bad-exit: a node whose train.sh fails ends the others instead of leaving them to wait.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash scripts/train.sh "$@"
