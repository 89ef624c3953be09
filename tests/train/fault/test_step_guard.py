"""The bad-step guard on real gloo ranks: a NaN step changes no weight and equals a run without its
batch, the ranks agree on every verdict, and bad steps in a row roll back or stop the run."""

import json
import math
from pathlib import Path

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.fault_injection import faults_env, nan
from tests.parity_utils import full_params
from tests.trainer_utils import tiny_run_config
from veomni.train.fault.guard import StepGuard
from veomni.train.fault.stop import RunStopped
from veomni.train.trainer import Trainer

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)


def _verdicts(rank, world, losses):
    """Rank 0 sees ``losses``; rank 1 always a finite 1.0 (one rank's overflow, say)."""
    guard = StepGuard(spike_factor=3.0, window=2)
    return [guard.verdict(loss if rank == 0 else 1.0, 1.0) for loss in losses]


def test_ranks_agree_and_spikes_are_measured_against_good_steps():
    losses = [1.0, math.nan, 1.0, 2.0, 10.0, math.inf, 1.5]
    verdicts = run_distributed(_verdicts, 2, losses)
    assert verdicts[0] == verdicts[1]
    # the window (2 good losses) is full from the 4th step on: mean 1.5, so 10 is a spike, 1.5 is not
    assert verdicts[0] == ["", "non-finite loss", "", "", "loss spike", "non-finite loss", ""]


def _steps_with_nan_at_3(rank, world, tmp):
    trainer = Trainer(tiny_run_config(Path(tmp), max_steps=5))
    losses = [trainer.run_step()["loss"] for _ in range(2)]
    before = full_params(trainer.model)
    bad = trainer.run_step()
    after = full_params(trainer.model)
    losses += [trainer.run_step()["loss"] for _ in range(3)]
    return losses, bad, trainer.step, before, after, trainer.scheduler.last_epoch, full_params(trainer.model)


def _steps_without_the_third_batch(rank, world, tmp):
    trainer = Trainer(tiny_run_config(Path(tmp), max_steps=5))
    losses = [trainer.run_step()["loss"] for _ in range(2)]
    trainer.feed.next_step()  # the micro-batches the other run's step 3 drew
    losses += [trainer.run_step()["loss"] for _ in range(3)]
    return losses, full_params(trainer.model)


def test_nan_step_is_skipped_and_equals_a_run_without_its_batch(tmp_path):
    poisoned = run_distributed(_steps_with_nan_at_3, 2, str(tmp_path / "a"), env=faults_env(nan(step=3)))[0]
    losses, bad, step, before, after, scheduler_steps, final = poisoned
    assert bad["skipped"] == "non-finite loss" and math.isnan(bad["loss"])
    for name in before:
        assert torch.equal(before[name], after[name]), f"{name} changed in a skipped step"
    assert step == 5 and scheduler_steps == 5  # 5 applied steps; the skipped one moved no schedule
    clean_losses, clean_params = run_distributed(_steps_without_the_third_batch, 2, str(tmp_path / "b"))[0]
    assert losses == clean_losses
    for name, value in clean_params.items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=0, msg=name)


def _run(rank, world, tmp, overrides):
    trainer = Trainer(tiny_run_config(Path(tmp), **overrides))
    try:
        trainer.train()
    except RunStopped as exc:
        return "stopped: " + str(exc)
    return trainer.step, trainer.rollbacks, trainer.runner.guard.skipped


def _records(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]


def test_bad_steps_in_a_row_roll_back_and_skip_the_window(tmp_path):
    results = run_distributed(_run, 2, str(tmp_path), {"max_steps": 7, "max_bad_steps": 3},
                              env=faults_env(nan(step=5, times=3)))
    assert results == [(7, 1, 3)] * 2
    records = _records(tmp_path)
    skipped = [r for r in records if "skipped" in r]
    assert [r["step"] for r in skipped] == [5, 5, 5] and skipped[-1]["skipped_steps"] == 3
    assert any(r.get("rolled_back_to") == 3 for r in records)  # checkpoint.interval=3
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    assert [s for s, _ in losses] == [1, 2, 3, 4, 4, 5, 6, 7]
    # step 4 after the rollback starts from step 3's weights again but reads the data after the bad
    # window: a different loss
    assert losses[3][1] != losses[4][1]
    last_step = [r for r in records if "loss" in r][-1]
    assert last_step["rollbacks"] == 1 and last_step["skipped_steps"] == 3


@pytest.mark.parametrize("overrides, needle", [
    ({"on_bad_steps": "stop", "max_bad_steps": 2}, "2 bad steps in a row at step 2 (last: non-finite loss); "
                                                   "train.on_bad_steps=stop"),
    ({"max_bad_steps": 2}, "there is no checkpoint under"),
], ids=["stop", "rollback-without-checkpoint"])
def test_bad_steps_that_cannot_be_rolled_back_stop_every_rank(tmp_path, overrides, needle):
    results = run_distributed(_run, 2, str(tmp_path), overrides, env=faults_env(nan(step=2, times=2)))
    assert results[0] == results[1] and results[0].startswith("stopped: "), results
    assert needle in results[0]
