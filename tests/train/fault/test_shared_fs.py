"""The start-up check that all ranks share ``train.output_dir`` (veomni/train/fault/shared_fs.py), on real
gloo ranks, and through ``scripts/train.sh`` with two nodes that each have their own folder."""

import os
import subprocess
import time

import pytest

from harness.gloo_ranks import run_distributed
from tests.launch.test_launch import QUICKSTART, REPO, SMALL, _free_port
from veomni.train.fault.shared_fs import MARKER_PREFIX, check_shared_output_dir
from veomni.train.fault.stop import RunStopped

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)


def _check(rank, world, folders, timeout_s):
    start = time.monotonic()
    try:
        check_shared_output_dir(folders[rank], timeout_s)
        outcome = "passed"
    except RunStopped as exc:
        outcome = str(exc)
    return outcome, time.monotonic() - start


def test_ranks_that_share_the_folder_pass_and_the_marker_is_removed(tmp_path):
    shared = tmp_path / "run" / "nested"
    results = run_distributed(_check, 2, [shared, shared], 5.0)
    assert [outcome for outcome, _ in results] == ["passed", "passed"]
    assert shared.is_dir() and not [p for p in shared.iterdir() if p.name.startswith(MARKER_PREFIX)]


def test_a_rank_with_another_folder_stops_every_rank_with_the_same_message(tmp_path):
    results = run_distributed(_check, 2, [tmp_path / "node0", tmp_path / "node1"], 1.0)
    messages = [outcome for outcome, _ in results]
    assert messages[0] == messages[1], messages
    message = messages[0]
    assert message.startswith("train.output_dir is not one folder shared by all nodes: rank 1 on "), message
    assert f"(its train.output_dir is {tmp_path / 'node1'})" in message
    assert f"wrote in {tmp_path / 'node0'} within 1 s (train.shared_fs_timeout_s)" in message
    assert "Checkpoints need a filesystem shared by all nodes" in message
    assert (tmp_path / "node1").is_dir(), "each rank makes its own output_dir before looking"
    assert all(seconds < 10 for _, seconds in results), results


def test_a_folder_that_cannot_be_made_is_named_with_the_reason(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    unmakeable = tmp_path / "a_file" / "run"
    on_rank0 = run_distributed(_check, 2, [unmakeable, tmp_path / "run"], 1.0)
    assert on_rank0[0][0] == on_rank0[1][0]
    assert on_rank0[0][0].startswith("rank 0 on ") and \
        f"could not write to train.output_dir {unmakeable}: cannot create it (Not a directory)" in on_rank0[0][0]
    on_rank1 = run_distributed(_check, 2, [tmp_path / "run", unmakeable], 1.0)
    assert on_rank1[0][0] == on_rank1[1][0]
    assert f"(its train.output_dir is {unmakeable}, cannot create it (Not a directory)) did not see" in on_rank1[0][0]


def test_two_nodes_with_their_own_output_dir_stop_before_the_first_step(tmp_path):
    env = {**os.environ, "NNODES": "2", "NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "RDZV_ID": f"test-{os.getpid()}"}
    nodes = [subprocess.Popen(["bash", str(REPO / "scripts" / "train.sh"), str(QUICKSTART), *SMALL,
                               "--train.max_steps", "2", "--train.output_dir", str(tmp_path / f"node{rank}"),
                               "--train.shared_fs_timeout_s", "2", "--train.max_restarts", "2"],
                              cwd=REPO, env={**env, "NODE_RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = [node.communicate(timeout=300)[0] for node in nodes]
    for rank, log in enumerate(logs):
        assert nodes[rank].returncode == 1, log[-4000:]
        assert "[train.sh] run stopped: train.output_dir is not one folder shared by all nodes: rank 1 on " in log
        assert "Checkpoints need a filesystem shared by all nodes" in log, log[-4000:]
        assert "step 1 " not in log and "Traceback" not in log, log[-4000:]
        assert "restart 1" not in log, "a stop must not be retried"
    assert not (tmp_path / "node0" / "checkpoints").exists()
