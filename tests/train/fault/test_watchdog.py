"""Hang detection: a stalled rank makes the others fail within the timeout, each with a report
naming the collective it waits in (veomni/train/fault/watchdog.py, hang_report.py)."""

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from harness.gloo_ranks import run_distributed
from tests.launch.test_launch import QUICKSTART, SMALL, train_sh
from veomni.train.fault.hang_report import locate
from veomni.train.fault.watchdog import HANG_EXIT_CODE, Watchdog

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)


def _probe_during_barrier(rank, world, tmp):
    """Rank 1 sleeps before the barrier, rank 0 waits in it; each rank's own thread looks at its
    main thread meanwhile (which also shows gloo releases the GIL while it waits)."""
    main = threading.get_ident()
    seen = {}
    watchdog = Watchdog(600, Path(tmp), rank, "gloo", armed=True)
    probe = threading.Timer(0.4, lambda: seen.update(where=locate(sys._current_frames()[main])))
    probe.start()
    if rank == 1:
        time.sleep(1.0)
    dist.barrier()
    probe.join()
    waited = watchdog.waited_s()
    watchdog.stop()
    return seen["where"], waited


def test_report_names_the_collective_and_the_rank_outside_it(tmp_path):
    (waiting, waited_0), (sleeping, waited_1) = run_distributed(_probe_during_barrier, 2, str(tmp_path))
    assert waiting.collective.startswith("barrier (torch/distributed/distributed_c10d.py:")
    assert any("_probe_during_barrier" in caller for caller in waiting.called_from), waiting.called_from
    assert sleeping.collective is None
    assert sleeping.innermost.endswith("time.sleep(1.0)") and "_probe_during_barrier" in sleeping.innermost
    assert waited_0 > 0.5 and waited_1 < 0.3, (waited_0, waited_1)


def test_stalled_rank_fails_the_attempt_fast_with_hang_reports_and_the_restart_finishes(tmp_path):
    out = tmp_path / "run"
    start = time.monotonic()
    result = train_sh(str(QUICKSTART), *SMALL, "--train.max_steps", "5", "--train.eval_interval", "0",
                      "--checkpoint.interval", "2", "--train.output_dir", str(out), "--train.max_restarts", "1",
                      "--train.collective_timeout_s", "3",
                      env={"VEOMNI_FAULTS": "stall:rank=1:step=3:seconds=600"}, timeout=200)
    took = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"failed (exitcode: {HANG_EXIT_CODE})" in result.stderr  # the stalled attempt ended itself
    assert took < 90, f"the run took {took:.0f} s: the hang was not cut short"
    waiting = (out / "hang_reports" / "rank_00000.txt").read_text()
    stalled = (out / "hang_reports" / "rank_00001.txt").read_text()
    assert "rank 0" in waiting and "phase 'step 3'" in waiting
    assert re.search(r"waiting in collective (all_reduce|all_gather\w*|barrier|reduce_scatter\w*) \(", waiting), waiting
    assert "not in a collective" in stalled and "veomni/train/fault/injection.py" in stalled, stalled
    assert waiting.splitlines()[0] in result.stderr  # the report is in the log too
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert steps == [1, 2, 3, 4, 5]  # the restart resumed from step 2's checkpoint and finished


WARMUP_THEN_STUCK = """
import sys, time
from pathlib import Path
from veomni.train.fault.watchdog import Watchdog
watchdog = Watchdog(0.5, Path(sys.argv[1]), 3, "gloo", armed=True)
watchdog.beat("step 1")
time.sleep(1.0)  # over the timeout, within the first step's warm-up allowance
watchdog.beat("step 2")
time.sleep(30)
"""


def test_first_phase_of_a_kind_gets_the_warm_up_allowance_then_the_timeout_applies(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(WARMUP_THEN_STUCK)
    start = time.monotonic()
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == HANG_EXIT_CODE, result.stderr
    assert time.monotonic() - start < 15
    report = (tmp_path / "rank_00003.txt").read_text()
    assert "phase 'step 2', limit 0.5 s (train.collective_timeout_s)" in report, report
    assert "not in a collective" in report and "time.sleep(30)" in report
