"""Verified checkpoints: damaged files are found before loading, ``resume: auto`` falls back to the
previous intact checkpoint and says so, and a rank-state file is data, never code."""

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.fault_injection import flip_byte, plant_pickle, truncate
from tests.parity_utils import full_params
from tests.trainer_utils import tiny_run_config
from veomni.checkpoint.manager import list_checkpoints, resolve_resume
from veomni.launch import main as launch
from veomni.train.fault.stop import RunStopped
from veomni.train.trainer import Trainer

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)


def _train(rank, world, tmp, steps):
    Trainer(tiny_run_config(Path(tmp), max_steps=steps)).train()


def _resume(rank, world, tmp):
    """(the checkpoint resumed from, the step reached) or the stop message."""
    try:
        trainer = Trainer(tiny_run_config(Path(tmp), max_steps=7))
    except RunStopped as exc:
        return str(exc)
    trainer.train()
    return trainer.resume_path.name, trainer.step


def _checkpoints(tmp: Path) -> dict[int, Path]:
    return dict(list_checkpoints(tmp / "out" / "checkpoints"))


@pytest.fixture
def two_checkpoints(tmp_path):
    """A 2-rank run saved at steps 3 and 6 (checkpoint.interval=3)."""
    run_distributed(_train, 2, str(tmp_path), 6)
    assert sorted(_checkpoints(tmp_path)) == [3, 6]
    return tmp_path


def test_complete_json_records_every_file(two_checkpoints):
    folder = _checkpoints(two_checkpoints)[6]
    recorded = json.loads((folder / "complete.json").read_text())["files"]
    on_disk = sorted(p.name for p in folder.iterdir() if p.name != "complete.json")
    assert sorted(recorded) == on_disk and "rank_00001.pt" in on_disk
    for name, entry in recorded.items():
        data = (folder / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


@pytest.mark.parametrize("damage", [truncate, flip_byte], ids=["truncated", "corrupted"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(two_checkpoints, damage, caplog):
    newest = _checkpoints(two_checkpoints)[6]
    damage(newest / "__1_0.distcp")
    if damage is truncate:  # the launcher's size check sees it too, and says so
        with caplog.at_level(logging.WARNING):
            chosen = resolve_resume("auto", newest.parent)
        assert chosen.name == "step_00000003"
        assert f"{newest / '__1_0.distcp'} is " in caplog.text and "truncated" in caplog.text
        assert "resuming from the previous complete checkpoint" in caplog.text
    assert run_distributed(_resume, 2, str(two_checkpoints)) == [("step_00000003", 7)] * 2


def test_damaged_only_checkpoint_stops_the_run_naming_the_file(tmp_path, capsys):
    run_distributed(_train, 2, str(tmp_path), 3)
    only = _checkpoints(tmp_path)[3]
    flip_byte(only / "rank_00000.pt")
    messages = run_distributed(_resume, 2, str(tmp_path))
    assert messages[0] == messages[1]
    assert f"{only / 'rank_00000.pt'} does not match the SHA-256" in messages[0]
    assert "no intact checkpoint to resume from" in messages[0]
    truncate(only / "rank_00000.pt")  # a size the launcher can see: refused before any worker starts
    cfg = tiny_run_config(tmp_path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({"data": {"train_path": cfg.data.train_path, "format": "jsonl",
                                           "text_key": "text", "tokenizer": cfg.data.tokenizer},
                                  "train": {"output_dir": cfg.train.output_dir}}))
    assert launch([str(recipe), "--model.vocab_size", "8192", "--launcher-world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert f"config error: no intact checkpoint to resume from under {only.parent}" in err
    assert f"{only / 'rank_00000.pt'} is " in err and "Traceback" not in err


def test_planted_pickle_in_rank_state_is_refused_and_never_runs(two_checkpoints):
    folder = _checkpoints(two_checkpoints)[6]
    marker = two_checkpoints / "pwned"
    plant_pickle(folder, "rank_00000.pt", marker)  # checksums rewritten: the load itself must refuse it
    messages = run_distributed(_resume, 2, str(two_checkpoints))
    assert "holds a pickled object other than tensors and plain values; refusing to load it" in messages[0]
    assert str(folder / "rank_00000.pt") in messages[0] and messages[0] == messages[1]
    assert not marker.exists(), "the planted payload ran"


def _weights_after_resume(rank, world, tmp):
    trainer = Trainer(tiny_run_config(Path(tmp), max_steps=6))
    return full_params(trainer.model)


def test_intact_checkpoint_loads_the_saved_weights(two_checkpoints):
    """The verification does not stand in the way of a good checkpoint: resuming at step 6 gives
    the weights that were saved there (read back by DCP on one process)."""
    import torch.distributed.checkpoint as dcp

    folder = _checkpoints(two_checkpoints)[6]
    resumed = run_distributed(_weights_after_resume, 2, str(two_checkpoints))[0]
    saved = {name: torch.empty_like(value) for name, value in resumed.items()}
    dcp.load({"model": saved}, checkpoint_id=str(folder), no_dist=True)
    for name, value in resumed.items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=name)
