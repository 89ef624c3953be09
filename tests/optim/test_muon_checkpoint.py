"""Checkpoints of a Muon run (Muon and AdamW in one part, under FSDP): a crash after step 3 and a
resume give the uninterrupted run's losses bit for bit, and a checkpoint saved at 4 ranks loads
at 2 with every weight, every AdamW moment and every Muon momentum equal."""

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from harness.gloo_ranks import run_distributed
from tests.parity_utils import full_params
from tests.trainer_utils import tiny_run_config
from veomni.train.trainer import Trainer

pytestmark = pytest.mark.full  # whole trainer runs: the full tier (tests/conftest.py)


def _config(tmp: str, **train):
    return tiny_run_config(Path(tmp), optimizer="muon", **train)


def _losses(rank, world, tmp):
    return [m["loss"] for m in Trainer(_config(tmp)).train()]


def _crash_after_3_then_resume(rank, world, tmp):
    first = Trainer(_config(tmp))
    before = [first.run_step()["loss"] for _ in range(3)]  # checkpoint.interval=3 saves here
    del first  # the process "dies": no final save
    second = Trainer(_config(tmp))
    assert second.step == 3
    return before + [m["loss"] for m in second.train()]


@pytest.mark.parametrize("world", [1, 2])
def test_resume_gives_the_uninterrupted_losses(tmp_path, world):
    full = run_distributed(_losses, world, str(tmp_path / "a"))[0]
    resumed = run_distributed(_crash_after_3_then_resume, world, str(tmp_path / "b"))[0]
    assert len(full) == 6 and resumed == full


def _state(trainer) -> dict:
    whole = {}
    for index, entry in trainer.optimizer.state_dict()["state"].items():
        for key, value in entry.items():
            whole[f"{index}.{key}"] = value.full_tensor() if isinstance(value, DTensor) else value
    return whole


def _save_at(rank, world, tmp):
    trainer = Trainer(_config(tmp, max_steps=3))
    trainer.train()
    return full_params(trainer.model), _state(trainer)


def _load_at(rank, world, tmp):
    trainer = Trainer(_config(tmp, max_steps=4))
    return trainer.step, full_params(trainer.model), _state(trainer)


def test_saved_at_4_ranks_loads_at_2(tmp_path):
    params, state = run_distributed(_save_at, 4, str(tmp_path))[0]
    step, loaded_params, loaded_state = run_distributed(_load_at, 2, str(tmp_path))[0]
    assert step == 3
    assert any(key.endswith("momentum_buffer") for key in state) and any(key.endswith("exp_avg") for key in state)
    assert loaded_state.keys() == state.keys()
    for name, value in {**params, **state}.items():
        torch.testing.assert_close({**loaded_params, **loaded_state}[name], value, rtol=0, atol=0, msg=name)
