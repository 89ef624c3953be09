"""A checkpoint of another kind of run in ``train.output_dir`` (full fine-tuning then LoRA, other
model dimensions, another LoRA base) is refused by the launcher, dry run and real run alike, naming
the folder and the two ways on, before any worker starts; a worker that meets one anyway (started
without the launcher) stops the run once, with no traceback and no restart loop."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoint.test_init_from_hf_checks import DENSE, _hf_folder
from tests.config.test_bad_recipes import BASE, launch_both_modes
from tests.launch.test_launch import REPO, train_sh
from tests.trainer_utils import TOKENIZER, write_corpus
from veomni.checkpoint.manager import list_checkpoints
from veomni.checkpoint.run_identity import IDENTITY_KEY, run_identity
from veomni.checkpoint.verify import COMPLETE_MARKER
from veomni.config.load import load_config
from veomni.contract import build_config

pytestmark = pytest.mark.full  # whole train.sh runs

LORA = ["--lora.rank", "4"]
REFUSAL = (r"config error: {folder}/step_\d+ is a checkpoint of another kind of run: {why}.*Train into a new "
           r"folder \(train\.output_dir\), or set checkpoint\.resume: none")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A full fine-tuning run's checkpoint (``full``, 2 steps of BASE through ``scripts/train.sh``),
    and a copy whose record says a LoRA run wrote it (``lora``)."""
    folder = tmp_path_factory.mktemp("run_identity")
    write_corpus(folder / "corpus" / "train", documents=20, seed=0)
    write_corpus(folder / "corpus" / "eval", documents=4, seed=1)
    (folder / "r.yaml").write_text(BASE.format(tokenizer=TOKENIZER))
    result = train_sh(str(folder / "r.yaml"), "--train.output_dir", str(folder / "full"))
    assert result.returncode == 0, result.stderr
    lora = load_config(folder / "r.yaml", LORA)
    _rewrite_identity(folder, "full", "lora", run_identity(lora, build_config(lora.model.arch, lora.model.options)))
    return folder


def _rewrite_identity(runs: Path, out: str, copy: str, identity: dict | None) -> str:
    """A copy of run ``out`` whose checkpoints record ``identity`` (None: none, as an older version wrote)."""
    shutil.rmtree(runs / copy, ignore_errors=True)
    shutil.copytree(runs / out, runs / copy)
    for _, path in list_checkpoints(runs / copy / "checkpoints"):
        meta = {k: v for k, v in json.loads((path / COMPLETE_MARKER).read_text()).items() if k != IDENTITY_KEY}
        (path / COMPLETE_MARKER).write_text(json.dumps(meta if identity is None else {**meta, IDENTITY_KEY: identity}))
    return copy


def _refused_alike(runs: Path, out: str, flags: list[str], why: str, monkeypatch, capsys) -> None:
    monkeypatch.chdir(runs)
    (dry_status, dry_output), (status, output) = launch_both_modes(
        runs / "r.yaml", ["--train.output_dir", str(runs / out), *flags], capsys)
    for exit_status, text in ((dry_status, dry_output), (status, output)):
        assert exit_status == 2, text
        assert "Traceback" not in text, text
        assert re.search(REFUSAL.format(folder=re.escape(str(runs / out / "checkpoints")), why=why), text), text
    assert dry_output == output


@pytest.mark.parametrize("out, flags, why", [
    ("full", LORA, r"it was written by a run that trained the whole model \(full fine-tuning\), and this run "
                   r"trains LoRA adapters"),
    ("lora", [], r"it was written by a run that trained LoRA adapters, and this run trains the whole model"),
    ("full", ["--model.intermediate_size", "96"], r"model\.intermediate_size: checkpoint 64, recipe 96"),
    ("lora", [*LORA, "--train.seed", "7"], r"lora\.seed: checkpoint 42, recipe 7"),
], ids=["full-then-lora", "lora-then-full", "other-dims", "other-lora-base"])
def test_another_kind_of_run_is_refused_at_launch(runs, out, flags, why, monkeypatch, capsys):
    _refused_alike(runs, out, flags, why, monkeypatch, capsys)


def test_the_same_run_resumes(runs, monkeypatch, capsys):
    monkeypatch.chdir(runs)
    for out, flags in (("full", []), ("full", ["--train.lr", "1e-3"])):
        for status, output in launch_both_modes(runs / "r.yaml", ["--train.output_dir", str(runs / out), *flags],
                                                capsys):
            assert status == 0, output


def test_an_older_checkpoint_is_compared_by_its_keys(runs, monkeypatch, capsys):
    """No identity recorded: the DCP metadata's keys and shapes against the model's, no tensor read."""
    _refused_alike(runs, _rewrite_identity(runs, "full", "old", None), LORA,
                   r"it lacks \d+ of this model's weights \(layers\.0\.attn\.\w+_proj\.lora_A", monkeypatch, capsys)
    _refused_alike(runs, "old", ["--model.intermediate_size", "96"],
                   r"weights of other shapes: layers\.0\.mlp\.\w+\.weight \[\d+, \d+\] in the checkpoint", monkeypatch,
                   capsys)


def test_a_lora_resume_checks_the_base_folder(runs, tmp_path, monkeypatch, capsys):
    """A LoRA run loads its base folder at every start, resumes included: a folder that does not fit
    is refused by the plan as by the launch (it once passed both, and the workers refused it)."""
    import transformers

    folder = _hf_folder(tmp_path / "hf", transformers.Qwen3Config(**dict(DENSE, intermediate_size=96)))
    capsys.readouterr()  # save_pretrained's progress bar
    monkeypatch.chdir(runs)
    results = launch_both_modes(runs / "r.yaml", ["--train.output_dir", str(runs / "full"), *LORA,
                                                  "--checkpoint.init_from_hf", str(folder)], capsys)
    for status, output in results:
        assert status == 2 and "intermediate_size: recipe 64, folder 96" in output, output
    assert results[0][1] == results[1][1]


def test_train_sh_starts_no_worker(runs):
    result = train_sh(str(runs / "r.yaml"), "--train.output_dir", str(runs / "full"), *LORA)
    assert result.returncode == 2, result.stderr
    assert "is a checkpoint of another kind of run" in result.stderr and "Traceback" not in result.stderr
    assert "process(es)" not in result.stderr, "workers were launched"


def test_workers_stop_once_without_the_launcher(runs, tmp_path):
    """Workers started as train.sh starts them, without its launcher's check, on a checkpoint of a
    full run with LoRA on: every rank stops at its key check, before loading, with the message in the
    stop file and no traceback; torchrun restarts nothing (exit 0, one start)."""
    stop_file = tmp_path / "stop"
    stop_file.touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    env.update(VEOMNI_STOP_FILE=str(stop_file), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-m", "veomni.torchrun", "--standalone", "--nproc-per-node=2", "--max-restarts=3",
         "-m", "veomni.train.run", str(runs / "r.yaml"), "--train.output_dir", str(runs / "full"), *LORA],
        cwd=runs, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "restart" not in result.stderr.lower(), result.stderr
    assert "is a checkpoint of another kind of run: it lacks" in stop_file.read_text(), stop_file.read_text()
