"""Checkpoints: exact resume after a crash, resharding across world sizes, crash safety."""

import hashlib
import json
from pathlib import Path

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.parity_utils import full_params
from tests.trainer_utils import tiny_run_config
from veomni.checkpoint.manager import CheckpointSaveError, list_checkpoints, resolve_resume
from veomni.train.trainer import Trainer

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)


def _losses(history):
    return [m["loss"] for m in history]


def _config(tmp, async_save=False):
    cfg = tiny_run_config(Path(tmp))
    cfg.checkpoint.async_save = async_save
    return cfg


def _uninterrupted(rank, world, tmp):
    return _losses(Trainer(tiny_run_config(Path(tmp))).train())


def _crash_after_3_then_resume(rank, world, tmp, async_save):
    first = Trainer(_config(tmp, async_save))
    before = [first.run_step()["loss"] for _ in range(3)]  # checkpoint.interval=3 saves here
    first.checkpoints.wait()  # an async save must be published before the "crash"
    del first  # the process "dies" here: no finish(), no final save
    second = Trainer(_config(tmp, async_save))
    assert second.step == 3
    return before, _losses(second.train())


@pytest.mark.parametrize("world, async_save", [(1, False), (2, False), (2, True)],
                         ids=["1rank", "2ranks", "2ranks-async"])
def test_resume_continues_with_identical_losses(tmp_path, world, async_save):
    full = run_distributed(_uninterrupted, world, str(tmp_path / "a"))[0]
    before, after = run_distributed(_crash_after_3_then_resume, world, str(tmp_path / "b"), async_save)[0]
    assert len(full) == 6 and len(after) == 3
    assert before == full[:3]
    assert after == full[3:], "resumed losses differ from the uninterrupted run"


def _train_and_snapshot(rank, world, tmp):
    trainer = Trainer(tiny_run_config(Path(tmp), max_steps=3))
    trainer.train()
    state = trainer.optimizer.state_dict()["state"]
    exp_avg = {k: (v["exp_avg"].full_tensor() if hasattr(v["exp_avg"], "full_tensor") else v["exp_avg"])
               for k, v in state.items()}
    return full_params(trainer.model), exp_avg


def _resume_and_snapshot(rank, world, tmp):
    trainer = Trainer(tiny_run_config(Path(tmp), max_steps=4))
    params = full_params(trainer.model)
    state = trainer.optimizer.state_dict()["state"]
    exp_avg = {k: (v["exp_avg"].full_tensor() if hasattr(v["exp_avg"], "full_tensor") else v["exp_avg"])
               for k, v in state.items()}
    step = trainer.step
    history = trainer.train()
    return params, exp_avg, step, _losses(history)


def test_checkpoint_saved_at_4_ranks_resumes_at_2(tmp_path):
    saved_params, saved_avg = run_distributed(_train_and_snapshot, 4, str(tmp_path))[0]
    params, avg, step, losses = run_distributed(_resume_and_snapshot, 2, str(tmp_path))[0]
    assert step == 3 and len(losses) == 1 and torch.isfinite(torch.tensor(losses)).all()
    for name, value in saved_params.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=0)
    for key, value in saved_avg.items():
        torch.testing.assert_close(avg[key], value, rtol=0, atol=0)


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("disk full (simulated)")


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def _crash_during_save(rank, world, tmp):
    trainer = Trainer(tiny_run_config(Path(tmp), max_steps=3))
    trainer.train()  # publishes step 3
    root = trainer.output_dir / "checkpoints"
    good = list_checkpoints(root)[-1][1]
    before = _digest(good)
    trainer.step = 4
    with pytest.raises(CheckpointSaveError, match="previous checkpoints .* are untouched"):
        state = trainer._app_state()
        state["poison"] = _Unpicklable()
        trainer.checkpoints.save(4, trainer.model, trainer.optimizer, state, trainer._rank_state())
    return str(good), before, _digest(good), [p.name for _, p in list_checkpoints(root)], str(root)


def test_crash_mid_save_keeps_last_good_checkpoint(tmp_path):
    good, before, after, complete, root = run_distributed(_crash_during_save, 2, str(tmp_path))[0]
    assert before == after
    assert complete == ["step_00000003"]
    assert resolve_resume("auto", Path(root)) == Path(good)


def _train_only(rank, world, cfg):
    Trainer(cfg).train()


def test_keep_last_and_incomplete_folders(tmp_path):
    cfg = tiny_run_config(tmp_path, max_steps=6)
    cfg.checkpoint.interval = 1
    cfg.checkpoint.keep_last = 2
    run_distributed(_train_only, 1, cfg)
    root = Path(cfg.train.output_dir) / "checkpoints"
    assert [p.name for _, p in list_checkpoints(root)] == ["step_00000005", "step_00000006"]
    meta = json.loads((root / "step_00000006" / "complete.json").read_text())
    assert meta["step"] == 6 and meta["world_size"] == 1
    # a folder without the completion marker (a crash before publish) is never resumed from
    (root / "step_00000009").mkdir()
    assert resolve_resume("auto", root).name == "step_00000006"
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        resolve_resume(str(root / "step_00000009"), root)


def _preempted(rank, world, tmp):
    import signal

    trainer = Trainer(tiny_run_config(Path(tmp), max_steps=50))
    trainer.run_step()
    if rank == 1:
        signal.raise_signal(signal.SIGTERM)  # as a scheduler would, to one rank
    history = trainer.train()
    return len(history), trainer.step, trainer.preempted


def test_sigterm_checkpoints_and_stops_all_ranks(tmp_path):
    results = run_distributed(_preempted, 2, str(tmp_path))
    assert results == [(1, 2, True), (1, 2, True)]  # both ranks stop after the same step
    found = list_checkpoints(tmp_path / "out" / "checkpoints")
    assert [step for step, _ in found] == [2]
