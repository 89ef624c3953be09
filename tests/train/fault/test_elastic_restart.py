"""A rank killed mid-run, launched once through ``bash scripts/train.sh``: torchrun restarts the
worker group, which resumes from the newest checkpoint, and the run finishes with the losses of an
uninterrupted run (same seed, same data)."""

import json
import os
import subprocess

import pytest

from tests.fault_injection import faults_env, kill
from tests.launch.test_launch import QUICKSTART, REPO, SMALL, _free_port, train_sh
from tests.parity_utils import assert_scalar_parity

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

RUN = [str(QUICKSTART), *SMALL, "--train.max_steps", "12", "--checkpoint.interval", "5",
       "--train.eval_interval", "0"]


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(records: list[dict]) -> dict[int, float]:
    """Loss per step; a step run again after a restart keeps its last value."""
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    result = train_sh(*RUN, "--train.output_dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return _losses(_records(out))


def test_sigkill_of_rank_0_at_step_8_restarts_and_matches_the_uninterrupted_run(tmp_path, uninterrupted):
    """Rank 0, which writes the metrics and publishes checkpoints (a killed rank 1: the two-node
    test below)."""
    out = tmp_path / "run"
    result = train_sh(*RUN, "--train.output_dir", str(out), env=faults_env(kill(rank=0, step=8)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kill on rank 0 at step 8" in result.stderr and "run summary: 12 steps" in result.stderr
    records = _records(out)
    losses = _losses(records)
    assert sorted(losses) == list(range(1, 13))
    for step in range(1, 13):  # 1-7 from the first attempt, 6-12 after the restart
        assert_scalar_parity(losses[step], uninterrupted[step], f"step {step} loss")
    # the restart resumed from step 5; steps 6-7 had run before the kill and ran again
    first_after = next(r for r in records if r.get("restarts") == 1)
    assert (first_after["step"], first_after["steps_lost"]) == (6, 2)
    assert all(r.get("restarts") == 1 for r in records[records.index(first_after):] if "loss" in r)


def test_a_dead_node_restarts_both_nodes(tmp_path, uninterrupted):
    """Two nodes (one process each, on loopback): rank 1 is killed; both nodes' agents restart their
    workers, which meet again and finish the run with the same losses."""
    out = tmp_path / "run"
    env = {**os.environ, "NNODES": "2", "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "RDZV_ID": f"restart-{os.getpid()}", **faults_env(kill(rank=1, step=8))}
    args = ["bash", str(REPO / "scripts" / "train.sh"), *RUN, "--train.output_dir", str(out)]
    nodes = [subprocess.Popen(args, cwd=REPO, env={**env, "NODE_RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(logs)[-4000:]
    # the rendezvous numbers ranks in the order the nodes join: rank 1 may be on either node
    assert "kill on rank 1 at step 8" in "".join(logs) and all("restart 1 (of at most 3): resumed at step 5" in log
                                                  for log in logs)
    losses = _losses(_records(out))
    for step in range(6, 13):
        assert_scalar_parity(losses[step], uninterrupted[step], f"step {step} loss")


def test_no_restarts_lets_a_dead_rank_end_the_run(tmp_path):
    result = train_sh(*RUN, "--train.max_steps", "4", "--checkpoint.interval", "2",
                      "--train.max_restarts", "0", "--train.output_dir", str(tmp_path / "run"),
                      env=faults_env(kill(rank=1, step=3)))
    assert result.returncode != 0
    assert "kill on rank 1 at step 3" in result.stderr and "run summary" not in result.stderr
