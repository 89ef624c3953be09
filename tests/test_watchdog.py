"""Hang detection: a stalled rank makes the others fail within the timeout, each with a report
naming the collective it waits in (veomni/train/watchdog.py, hang_report.py)."""

import re
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from tests.dist_harness import run_distributed
from tests.test_launch import QUICKSTART, SMALL, train_sh
from veomni.train.hang_report import locate
from veomni.train.watchdog import HANG_EXIT_CODE, Watchdog


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


def test_stalled_rank_makes_the_run_fail_fast_with_hang_reports(tmp_path):
    out = tmp_path / "run"
    start = time.monotonic()
    result = train_sh(str(QUICKSTART), *SMALL, "--train.max_steps", "6", "--train.eval_interval", "0",
                      "--checkpoint.interval", "0", "--train.output_dir", str(out), "--train.max_restarts", "0",
                      "--train.collective_timeout_s", "3",
                      env={"VEOMNI_FAULTS": "stall:rank=1:step=3:seconds=600"}, timeout=150)
    took = time.monotonic() - start
    assert result.returncode != 0 and f"exitcode  : {HANG_EXIT_CODE}" in result.stderr, result.stderr[-3000:]
    assert took < 100, f"the run took {took:.0f} s to fail"
    waiting = (out / "hang_reports" / "rank_00000.txt").read_text()
    stalled = (out / "hang_reports" / "rank_00001.txt").read_text()
    assert "rank 0" in waiting and "phase 'step 3'" in waiting
    assert re.search(r"waiting in collective (all_reduce|all_gather\w*|barrier|reduce_scatter\w*) \(", waiting), waiting
    assert "not in a collective" in stalled and "veomni/train/faults.py" in stalled, stalled
    assert waiting.splitlines()[0] in result.stderr  # the report is in the log too
