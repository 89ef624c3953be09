"""Straggler detection (veomni/train/fault/stragglers.py): known per-rank times, then a real 2-rank run
where one rank is slowed at every step."""

import json
import logging
from pathlib import Path

from harness.gloo_ranks import run_distributed
from tests.trainer_utils import tiny_run_config
from veomni.train.fault.stragglers import StragglerDetector
from veomni.train.trainer import Trainer

HOSTS = ["node-a", "node-a", "node-b", "node-b"]


def _feed(detector, steps):
    return [detector.observe(step, times) for step, times in enumerate(steps, start=1)]


def test_persistently_slow_rank_is_named_once_per_window(caplog):
    detector = StragglerDetector(factor=1.5, window=3, hosts=HOSTS)
    with caplog.at_level(logging.WARNING, logger="veomni.train.fault.stragglers"):
        results = _feed(detector, [[1.0, 1.1, 0.9, 2.0]] * 6)
    assert results[0] == results[1] == {} == results[3] == results[4]
    for result in (results[2], results[5]):
        assert result["stragglers"] == [3] and result["slowest_rank"] == 3
        assert abs(result["slowest_ratio"] - 2.0 / 1.0) < 1e-9  # lower median of 0.9, 1.0, 1.1, 2.0 is 1.0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert "rank 3 (host node-b)" in warnings[0] and "steps 1-3" in warnings[0] and "2.0x" in warnings[0]
    assert "steps 4-6" in warnings[1]


def test_one_slow_step_or_a_small_gap_is_not_a_straggler():
    one_spike = _feed(StragglerDetector(1.5, 4, HOSTS), [[1.0] * 4] * 3 + [[1.0, 1.0, 1.0, 2.5]])
    assert one_spike[-1]["stragglers"] == []  # rank 3's mean is 1.375: below 1.5 x 1.0
    tiny_steps = _feed(StragglerDetector(1.5, 2, HOSTS), [[0.01, 0.01, 0.01, 0.04]] * 2)
    assert tiny_steps[-1]["stragglers"] == [] and tiny_steps[-1]["slowest_rank"] == 3  # 4x, but only 30 ms


def test_ranks_are_compared_within_their_pipeline_stage():
    stages = [0, 0, 1, 1]
    balanced = _feed(StragglerDetector(1.5, 1, HOSTS, stages), [[1.0, 1.0, 2.0, 2.0]])[0]
    assert balanced["stragglers"] == []  # the second stage is slower by design, not a straggler
    slow = _feed(StragglerDetector(1.5, 1, HOSTS, stages), [[1.0, 1.0, 2.0, 4.0]])[0]
    assert slow["stragglers"] == [3] and slow["slowest_rank"] == 3 and slow["slowest_ratio"] == 2.0


def test_off_and_single_rank_report_nothing():
    assert _feed(StragglerDetector(0, 1, HOSTS), [[1.0, 1.0, 1.0, 9.0]]) == [{}]
    assert _feed(StragglerDetector(1.5, 1, ["solo"]), [[9.0]]) == [{}]


def _slowed_run(rank, world, tmp):
    Trainer(tiny_run_config(Path(tmp), max_steps=6, straggler_window=3, straggler_factor=1.5,
                            eval_interval=0)).train()


def test_slowed_rank_is_named_in_metrics(tmp_path):
    stalls = "; ".join(f"stall:rank=1:step={step}:seconds=0.3" for step in range(1, 7))
    run_distributed(_slowed_run, 2, str(tmp_path), env={"VEOMNI_FAULTS": stalls})
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if "stragglers" in r]
    assert [r["step"] for r in windows] == [3, 6]
    for record in windows:
        assert record["stragglers"] == [1] and record["slowest_rank"] == 1
        assert record["slowest_ratio"] > 1.5
