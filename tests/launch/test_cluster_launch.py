"""``scripts/train.sh`` reads the node layout from Slurm and Kubeflow by itself (scripts/_cluster.sh):
the detection on its own (quick), and two nodes on loopback, started by scripts/sbatch_example.sh or
as the Kubeflow training operator starts them, training together to the end."""

import json
import os
import random
import socket
import subprocess

import pytest

from tests.launch.test_launch import QUICKSTART, REPO, SMALL, _free_port

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

LAYOUT = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV_ID", "NPROC_PER_NODE", "WORLD_SIZE", "RANK")


def _clean_env(**variables: str) -> dict[str, str]:
    """This process's environment without any cluster's layout variables, plus ``variables``."""
    env = {k: v for k, v in os.environ.items() if k not in LAYOUT and not k.startswith(("SLURM_", "PET_"))}
    return {**env, **variables}


def _detect(**variables: str) -> subprocess.CompletedProcess:
    script = (f"set -euo pipefail; source {REPO / 'scripts' / '_cluster.sh'}; "
              'echo "$NNODES|$NODE_RANK|$MASTER_ADDR|$MASTER_PORT|$RDZV_ID|${NPROC_PER_NODE:-}|$LAYOUT_FROM"')
    return subprocess.run(["bash", "-c", script], env=_clean_env(**variables), capture_output=True, text=True,
                          timeout=30)


SRUN = dict(SLURM_JOB_ID="4321987", SLURM_NNODES="4", SLURM_NODEID="2", SLURM_STEP_ID="0",
            SLURM_STEP_NUM_NODES="4", SLURM_STEP_NUM_TASKS="4", SLURM_JOB_NODELIST="gpu-a[07-10]",
            SLURM_GPUS_ON_NODE="8")


@pytest.mark.parametrize("variables, layout", [
    ({}, "1|0|127.0.0.1|29500|veomni-29500||"),
    (dict(NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.5", MASTER_PORT="29400"),
     "2|1|10.0.0.5|29400|veomni-29400||NNODES/NODE_RANK"),
    (SRUN, "4|2|gpu-a07|16987|slurm-4321987|8|Slurm"),
    ({**SRUN, "SLURM_JOB_NODELIST": "node[01-04,07],login5"}, "4|2|node01|16987|slurm-4321987|8|Slurm"),
    ({**SRUN, "SLURM_JOB_NODELIST": "rack[2-3]-n[5-6]"}, "4|2|rack2-n5|16987|slurm-4321987|8|Slurm"),
    ({**SRUN, "SLURM_JOB_NODELIST": "a1,a2,a3,a4"}, "4|2|a1|16987|slurm-4321987|8|Slurm"),
    ({**SRUN, "MASTER_PORT": "1234", "NPROC_PER_NODE": "2", "RDZV_ID": "mine"}, "4|2|gpu-a07|1234|mine|2|Slurm"),
    ({**SRUN, "NNODES": "1"}, "1|0|127.0.0.1|29500|veomni-29500||NNODES/NODE_RANK"),
    (dict(SLURM_JOB_ID="12", SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="n1"), "1|0|n1|15012|slurm-12||Slurm"),
    # Kubeflow training-operator PyTorchJob, 2 replicas x nprocPerNode 8: WORLD_SIZE counts processes.
    (dict(MASTER_ADDR="job-master-0", MASTER_PORT="23456", WORLD_SIZE="16", RANK="1", PET_NNODES="2",
          PET_NODE_RANK="1", PET_NPROC_PER_NODE="8"), "2|1|job-master-0|23456|veomni-job-master-0|8|Kubeflow (PET_*)"),
    # Kubeflow Trainer TrainJob: PET_* only, nproc "auto".
    (dict(PET_NNODES="3", PET_NODE_RANK="2", PET_MASTER_ADDR="tj-node-0-0.tj", PET_MASTER_PORT="29400",
          PET_NPROC_PER_NODE="auto"), "3|2|tj-node-0-0.tj|29400|veomni-tj-node-0-0.tj||Kubeflow (PET_*)"),
], ids=["none", "user", "srun", "nodelist-list", "nodelist-two-brackets", "nodelist-plain", "user-wins-slurm",
        "user-nnodes-wins", "one-node-job", "pytorchjob", "trainjob"])
def test_layout_detection(variables, layout):
    result = _detect(**variables)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == layout


@pytest.mark.parametrize("variables, needle", [
    ({**SRUN, "SLURM_STEP_ID": ""}, "not running under srun, so only this node would start"),
    ({**SRUN, "SLURM_STEP_NUM_TASKS": "32"}, "srun started 32 tasks on 4 nodes; train.sh must run once per node"),
    (dict(PET_NNODES="1:4", PET_NODE_RANK="0", PET_MASTER_ADDR="m"), "PET_NNODES=1:4 is an elastic range"),
    (dict(NNODES="2", NODE_RANK="2"), "NODE_RANK=2 must be a number from 0 to NNODES-1 (NNODES=2)"),
], ids=["batch-step", "task-per-gpu", "elastic-range", "rank-out-of-range"])
def test_layout_that_cannot_work_fails_with_the_fix(variables, needle):
    result = _detect(**{k: v for k, v in variables.items() if v})
    assert result.returncode == 2 and needle in result.stderr, result.stderr


def _free_port_in(low: int, high: int) -> int:
    for port in random.sample(range(low, high), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high}")


def _two_nodes(out, node_env) -> list[str]:
    args = ["bash", str(REPO / "scripts" / "train.sh"), str(QUICKSTART), *SMALL, "--train.max_steps", "2",
            "--train.output_dir", str(out), "--checkpoint.interval", "0"]
    nodes = [subprocess.Popen(args, cwd=REPO, env=_clean_env(**node_env(rank)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(logs)[-4000:]
    return logs


def _checkpoint_layout(out) -> dict:
    return json.loads((out / "checkpoints" / "step_00000002" / "complete.json").read_text())


FAKE_SRUN = """#!/usr/bin/env bash
# Stands in for srun on a machine without Slurm: runs the command once per node of the job, as a
# step with one task per node would, each node's output in $SRUN_LOGS/nodeN.log.
echo "$@" > "$SRUN_LOGS/args"
while [[ "$1" == --* ]]; do shift; done
pids=()
for node in $(seq 0 $((SLURM_NNODES - 1))); do
    SLURM_NODEID=$node SLURM_STEP_ID=0 SLURM_STEP_NUM_NODES=$SLURM_NNODES SLURM_STEP_NUM_TASKS=$SLURM_NNODES \
        SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST "$@" > "$SRUN_LOGS/node$node.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


def test_the_sbatch_example_trains_two_nodes(tmp_path):
    """scripts/sbatch_example.sh in a 2-node job (srun stood in for): the port comes from the job
    id (15000 + its last 4 digits), the master from the node list, processes from the GPU count."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    port = _free_port_in(15000, 25000)
    job_id = str(7_000_000 + port - 15000)
    out = tmp_path / "run"
    env = _clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SRUN_LOGS=str(tmp_path), SLURM_JOB_ID=job_id,
                     SLURM_NNODES="2", SLURM_JOB_NODELIST="127.0.0.[1-2]", SLURM_GPUS_ON_NODE="1",
                     SLURM_SUBMIT_DIR=str(REPO))
    result = subprocess.run(["bash", str(REPO / "scripts" / "sbatch_example.sh"), str(QUICKSTART), *SMALL,
                             "--train.max_steps", "2", "--train.output_dir", str(out), "--checkpoint.interval", "0"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    logs = [(tmp_path / f"node{rank}.log").read_text() for rank in (0, 1)]
    assert result.returncode == 0, result.stderr + "\n".join(logs)[-4000:]
    assert (tmp_path / "args").read_text().startswith("--ntasks-per-node=1 ")
    for rank, log in enumerate(logs):
        assert (f"[train.sh] layout from Slurm: 2 nodes, this is node {rank}, master 127.0.0.1:{port}, "
                f"run id slurm-{job_id}") in log, log[-3000:]
        assert "2 node(s) x 1 process(es)" in log
    meta = _checkpoint_layout(out)
    assert (meta["world_size"], meta["run_id"]) == (2, f"slurm-{job_id}")


def test_two_nodes_of_a_kubeflow_job_train_together(tmp_path):
    port = str(_free_port())
    logs = _two_nodes(tmp_path / "run", lambda rank: dict(
        PET_NNODES="2", PET_NODE_RANK=str(rank), PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=port,
        PET_NPROC_PER_NODE="1"))
    for rank, log in enumerate(logs):
        assert (f"[train.sh] layout from Kubeflow (PET_*): 2 nodes, this is node {rank}, "
                f"master 127.0.0.1:{port}") in log, log[-3000:]
    meta = _checkpoint_layout(tmp_path / "run")
    assert (meta["world_size"], meta["run_id"]) == (2, "veomni-127.0.0.1")
