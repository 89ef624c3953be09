"""Which worker errors stop the run once and which restart it: bad input (``veomni.errors.BadInput``,
raised where input is checked) stops with one line and no traceback; any other error, a
``ValueError`` a bug raises included, keeps its traceback and exits non-zero so torchrun restarts."""

from __future__ import annotations

import pytest

from veomni.config.load import load_config
from veomni.data.sources import BadDataError, resolve_files
from veomni.errors import BadCheckpoint, BadConfig, BadData, MissingInput
from veomni.train import run
from veomni.train.fault.stop import STOP_FILE_ENV, restart_cannot_fix


@pytest.mark.parametrize("error, unfixable", [
    (BadConfig("lora.rank must be >= 0"), True),
    (BadData("sample 'x': turn 0 has no 'role'"), True),
    (BadCheckpoint("step_00000002 is a checkpoint of another kind of run"), True),
    (MissingInput("data path 'x' does not exist"), True),
    (BadDataError("3 of 10 records were bad"), True),
    (ValueError("too many values to unpack"), False),
    (FileNotFoundError("/tmp/scratch"), False),
    (RuntimeError("Missing key in checkpoint state_dict: model.x"), False),
], ids=["config", "data", "checkpoint", "missing", "bad-records", "bug-value-error", "bug-missing-file", "crash"])
def test_only_bad_input_is_unfixable_by_a_restart(error, unfixable):
    assert restart_cannot_fix(error) is unfixable


def test_input_checks_raise_bad_input_with_the_builtin_base_callers_catch(tmp_path):
    """The raise sites keep ``ValueError`` / ``FileNotFoundError`` as bases, and are bad input."""
    with pytest.raises(FileNotFoundError) as missing:
        resolve_files(str(tmp_path / "absent"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  max_steps: 0\n")
    with pytest.raises(ValueError) as config:
        load_config(recipe)
    assert restart_cannot_fix(missing.value) and restart_cannot_fix(config.value)


def _worker(monkeypatch, error: BaseException) -> None:
    def main(argv):
        raise error
    monkeypatch.setattr(run, "main", main)


def test_a_bug_keeps_its_traceback_and_restarts(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(STOP_FILE_ENV, str(tmp_path / "stop"))
    _worker(monkeypatch, ValueError("too many values to unpack"))
    assert run._run(["r.yaml"]) == 1
    assert "Traceback" in capsys.readouterr().err
    assert not (tmp_path / "stop").exists(), "a bug must not look like a stop"


def test_bad_input_stops_once_without_a_traceback(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(STOP_FILE_ENV, str(tmp_path / "stop"))
    _worker(monkeypatch, BadCheckpoint("step_00000002 is a checkpoint of another kind of run"))
    assert run._run(["r.yaml"]) == 1  # ends the group; the restarted workers find the message and leave
    assert "Traceback" not in capsys.readouterr().err
    assert (tmp_path / "stop").read_text() == "step_00000002 is a checkpoint of another kind of run\n"
    assert run._run(["r.yaml"]) == 0
