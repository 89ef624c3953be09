"""A requested stop through ``scripts/train.sh`` is clean: SIGTERM to the script (as a scheduler or
Ctrl-C would) checkpoints, says how to resume, prints the summary and exits 0, with no torchrun
traceback; the printed command resumes from that checkpoint, and ``veomni.inference.load_run`` then loads the
trained plug-in model for inference.

The family is the outside example (fast steps); the run is long enough that only the signal ends it.
"""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from veomni.inference import load_run

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "regression_family"
LONG_RUN = ["--train.max_steps", "100000", "--train.eval_interval", "0", "--checkpoint.interval", "0",
            "--log.progress_bar", "false"]


def _steps(output_dir: Path) -> list[int]:
    metrics = output_dir / "metrics.jsonl"
    if not metrics.is_file():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"loss"' in line]


def _long_run(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path, dict[str, str]]:
    """(the train.sh process, the recipe, the output folder, the environment) of the example
    family's long run on 2 processes, returned once it has taken 3 steps."""
    shutil.copytree(EXAMPLE, tmp_path / "family", ignore=shutil.ignore_patterns("data", "outputs", "__pycache__"))
    recipe, out = tmp_path / "family" / "recipe.yaml", tmp_path / "run"
    command = ["bash", str(REPO / "scripts" / "train.sh"), str(recipe), *LONG_RUN, "--train.output_dir", str(out)]
    env = {**os.environ, "NPROC_PER_NODE": "2"}
    proc = subprocess.Popen(command, cwd=recipe.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 240
    while len(_steps(out)) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    return proc, recipe, out, env


def test_sigterm_to_train_sh_checkpoints_summarises_and_exits_0(tmp_path):
    proc, recipe, out, env = _long_run(tmp_path)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output[-4000:]
    assert "Traceback" not in output and "SignalException" not in output, output[-4000:]
    stopped_at = _steps(out)[-1]
    assert f"stopped by SIGTERM at step {stopped_at} of 100000; checkpoint saved; resume with: " in output
    assert f"run summary: {stopped_at} steps" in output and "loss.png" in output
    assert "resume the run where it stopped" in output  # the summary's next command
    assert (out / "loss.png").is_file() and json.loads((out / "summary.json").read_text())["step"] == stopped_at
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step_{stopped_at:08d}"]
    resume = output.split("resume with: ", 1)[1].splitlines()[0].split()
    assert resume[resume.index("--train.max_steps") + 1] == "100000"  # the same run, resumed
    resume[resume.index("--train.max_steps") + 1] = str(stopped_at + 2)
    resumed = subprocess.run(resume, cwd=recipe.parent, env=env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert _steps(out)[-2:] == [stopped_at + 1, stopped_at + 2]

    # the plug-in family's trained weights, for inference, in one documented call
    model = load_run(out)
    rows = torch.load(tmp_path / "family" / "data" / "eval.pt")
    untrained = type(model)(model.config)
    untrained.init_weights()
    with torch.no_grad():
        trained_error = (model(rows["x"]) - rows["y"]).pow(2).mean()
        untrained_error = (untrained(rows["x"]) - rows["y"]).pow(2).mean()
    assert not model.training and trained_error < untrained_error


def test_sigterm_to_torchrun_itself_stops_the_workers_cleanly_without_a_traceback(tmp_path):
    """A scheduler that signals the whole job signals torchrun too: its agent passes the signal to
    the workers (checkpoint, resume line, summary) and ``veomni.torchrun`` ends with one line and
    the conventional status 128 + 15, no SignalException traceback."""
    proc, recipe, out, _ = _long_run(tmp_path)
    listed = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True).stdout.splitlines()
    agents = [int(line.split()[0]) for line in listed if "veomni.torchrun" in line and str(recipe) in line]
    assert len(agents) == 1, listed
    os.kill(agents[0], signal.SIGTERM)
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, output[-4000:]
    assert "Traceback" not in output and "SignalException" not in output, output[-4000:]
    stopped_at = _steps(out)[-1]
    assert f"stopped by SIGTERM at step {stopped_at} of 100000; checkpoint saved; resume with: " in output
    assert f"run summary: {stopped_at} steps" in output and "[torchrun] SIGTERM received" in output
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step_{stopped_at:08d}"]
