"""The randomness a task draws: two data-parallel ranks draw different noise, the sequence-parallel
ranks of one group draw the same, and a resumed run draws what the uninterrupted run drew.

The trainer hands ``task.prepare`` a generator seeded from (seed, step, micro-batch, dp rank) and
calls it on the whole row before sequence parallelism slices it. A recording task (the language
modelling task plus one ``torch.randn(4)`` per micro-batch) runs in the real trainer on 4 gloo
ranks laid out dp 2 x sp 2.
"""

from pathlib import Path

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.trainer_utils import tiny_run_config
from veomni.tasks import LanguageModelingTask, task_generator
from veomni.train.trainer import Trainer

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

GRAD_ACCUM = 2


class RecordingTask(LanguageModelingTask):
    """Language modelling that also draws 4 numbers per micro-batch, in the order the trainer asks."""

    def __init__(self) -> None:
        self.draws: list[torch.Tensor] = []

    def prepare(self, batch: dict, generator: torch.Generator | None = None, training: bool = True) -> dict:
        self.draws.append(torch.randn(4, generator=generator))
        return super().prepare(batch, generator, training)


def _config(tmp: str):
    cfg = tiny_run_config(Path(tmp), max_steps=4, grad_accum=GRAD_ACCUM)
    cfg.parallel.sp = 2
    cfg.data.eval_path = None  # training draws only
    cfg.checkpoint.interval = 2
    return cfg


def _keyed(draws: list[torch.Tensor], first_step: int) -> dict[tuple[int, int], torch.Tensor]:
    """(step, micro-batch) -> draw: the trainer prepares each step's micro-batches in order."""
    return {(first_step + k // GRAD_ACCUM, k % GRAD_ACCUM): d for k, d in enumerate(draws)}


def _uninterrupted(rank, world, tmp):
    task = RecordingTask()
    trainer = Trainer(_config(tmp), task=task)
    trainer.train()
    return trainer.meshes.dp_rank, trainer.meshes.sp.get_local_rank(), _keyed(task.draws, first_step=1)


def _crash_after_2_then_resume(rank, world, tmp):
    first = Trainer(_config(tmp), task=RecordingTask())
    for _ in range(2):
        first.run_step()  # checkpoint.interval=2 saves here
    del first  # the process "dies": no finish()
    task = RecordingTask()
    second = Trainer(_config(tmp), task=task)
    assert second.step == 2
    second.train()
    return _keyed(task.draws, first_step=3)


def test_dp_ranks_differ_sp_group_agrees_and_resume_replays(tmp_path):
    full = run_distributed(_uninterrupted, 4, str(tmp_path / "a"))
    layout = sorted((dp, sp) for dp, sp, _ in full)
    assert layout == [(0, 0), (0, 1), (1, 0), (1, 1)]
    draws = {(dp, sp): keyed for dp, sp, keyed in full}
    assert sorted(draws[0, 0]) == [(step, mb) for step in range(1, 5) for mb in range(GRAD_ACCUM)]
    for key in draws[0, 0]:
        for dp in (0, 1):  # one sequence-parallel group: the same noise on both halves of the row
            torch.testing.assert_close(draws[dp, 0][key], draws[dp, 1][key], rtol=0, atol=0)
        assert not torch.equal(draws[0, 0][key], draws[1, 0][key]), f"dp ranks drew the same noise at {key}"
    all_draws = [*draws[0, 0].values(), *draws[1, 0].values()]
    assert len({tuple(d.tolist()) for d in all_draws}) == len(all_draws), "two micro-batches drew alike"

    resumed = run_distributed(_crash_after_2_then_resume, 4, str(tmp_path / "b"))
    for (dp, sp, keyed), after in zip(full, resumed):
        assert sorted(after) == [(step, mb) for step in (3, 4) for mb in range(GRAD_ACCUM)]
        for key, value in after.items():
            torch.testing.assert_close(value, keyed[key], rtol=0, atol=0, msg=f"dp={dp} sp={sp} at {key}")


def _draw(*args, **kwargs) -> torch.Tensor:
    return torch.randn(8, generator=task_generator(*args, **kwargs))


def test_same_inputs_same_stream():
    torch.testing.assert_close(_draw(3, 7, 1, 0), _draw(3, 7, 1, 0), rtol=0, atol=0)
    torch.testing.assert_close(_draw(3, 7, 1, 0, stream="eval"), _draw(3, 7, 1, 0, "eval"), rtol=0, atol=0)


@pytest.mark.parametrize("changed", [
    dict(seed=4), dict(step=8), dict(micro_batch=2), dict(dp_rank=1), dict(stream="eval"),
], ids=["seed", "step", "micro_batch", "dp_rank", "stream"])
def test_each_input_changes_the_stream(changed):
    base = dict(seed=3, step=7, micro_batch=1, dp_rank=0, stream="train")
    assert not torch.equal(_draw(**base), _draw(**{**base, **changed}))


def test_streams_do_not_collide_by_concatenation():
    """(step 1, micro-batch 12) and (step 11, micro-batch 2) must not share a stream."""
    assert not torch.equal(_draw(0, 1, 12, 0), _draw(0, 11, 2, 0))
