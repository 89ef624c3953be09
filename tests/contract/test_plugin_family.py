"""A model family the engine has never seen, from a package outside the repository.

The shipped example ``examples/regression_family`` (a residual-MLP regressor on float rows, its
regression task, its ``toy_regression`` dataset kind and its ``data.prepare`` script) is copied
into a temporary folder and trained with ``bash scripts/train.sh`` on 2 CPU ranks (FSDP over
gloo), with no tokenizer and no zoo: whatever the engine still assumed about tokens or text
would fail here. A run that dies after its step-3 checkpoint and is started again must continue
with the losses of the uninterrupted run, and the model must learn.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.parity_utils import assert_scalar_parity
from veomni.config.schema import DataConfig
from veomni.contract import load_plugins
from veomni.data.kinds import DatasetRequest

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "regression_family"
TEST_RUN = ["--train.max_steps", "6", "--train.eval_interval", "3", "--checkpoint.interval", "3",
            "--log.progress_bar", "false"]


def _copy_example(folder: Path) -> Path:
    """The example as a user's own package: a copy outside the repository, without generated files."""
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns("data", "outputs", "__pycache__"))
    return folder / "recipe.yaml"


def _train(recipe: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NPROC_PER_NODE": "2"}  # VEOMNI_VENV passes through; CI's venv is the repo's .venv
    return subprocess.run(["bash", str(REPO / "scripts" / "train.sh"), str(recipe), *TEST_RUN, *overrides],
                          cwd=recipe.parent, env=env, capture_output=True, text=True, timeout=300)


def _records(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def _crashed_after_step_3(finished: Path, crashed: Path) -> None:
    """``crashed``: the output folder of the same run, had it died in step 4 (after its step-3 checkpoint)."""
    shutil.copytree(finished, crashed, ignore=shutil.ignore_patterns("step_00000006"))
    lines = (finished / "metrics.jsonl").read_text().splitlines()
    kept = [line for line in lines if json.loads(line)["step"] <= 3]
    (crashed / "metrics.jsonl").write_text("\n".join(kept) + "\n")


def test_plugin_family_trains_from_outside_the_repo_and_resumes_exactly(tmp_path):
    recipe = _copy_example(tmp_path / "user_package")
    out_a, out_b = tmp_path / "run_a", tmp_path / "run_b"
    uninterrupted = _train(recipe, "--train.output_dir", str(out_a))
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-4000:]
    assert "preparing data" in uninterrupted.stderr  # data.prepare ran the package's own script
    assert sorted(p.name for p in (out_a / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]

    _crashed_after_step_3(out_a, out_b)
    resumed = _train(recipe, "--train.output_dir", str(out_b))  # checkpoint.resume: auto
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stderr and "saved at step 3" in resumed.stderr

    records_a, records_b = _records(out_a), _records(out_b)
    steps_a = {r["step"]: r for r in records_a if "loss" in r}
    steps_b = [r for r in records_b if "loss" in r]
    assert [r["step"] for r in steps_b] == [1, 2, 3, 4, 5, 6]  # the resumed run ran steps 4-6 once each
    for record in steps_b[3:]:
        assert_scalar_parity(record["loss"], steps_a[record["step"]]["loss"], f"step {record['step']} loss")

    # Throughput is named after the task's unit (a sample), never after tokens.
    for record in records_a + records_b:
        assert not any("token" in key for key in record), record
    assert all(r["samples_per_s"] > 0 and r["samples"] == 2 * 32 for r in steps_a.values())

    # The model learns: held-out error well below the variance of y (the error of predicting its mean).
    y = torch.load(recipe.parent / "data" / "eval.pt", weights_only=True)["y"]
    evals = [r["eval_loss"] for r in records_a if "eval_loss" in r]
    assert len(evals) == 2 and evals[-1] < 0.5 * float(y.var()), (evals, float(y.var()))
    # ... and the end-of-run summary reads it against the task's own baseline, in samples.
    summary = json.loads((out_a / "summary.json").read_text())
    assert summary["baseline"]["loss"] == pytest.approx(float(y.var(unbiased=False)), rel=0.2)
    assert summary["below_baseline"] > 0 and "samples_per_s" in summary["training"]
    assert "run summary" in uninterrupted.stderr + uninterrupted.stdout


# ----- the dataset kind's contract, in one process ---------------------------------------------
def _rows_dataset(path: Path, dp_rank: int, dp_size: int, split: str = "train"):
    load_plugins([str(EXAMPLE / "toy_regression")])
    from toy_regression.data import RegressionRows

    cfg = DataConfig(tokens_per_micro_batch=4)
    return RegressionRows(DatasetRequest(cfg, str(path), split, tokenizer=None, dp_rank=dp_rank,
                                         dp_size=dp_size, seed=0, model_config=None))


def _row_ids(batch: dict) -> list[int]:
    return batch["x"][:, 0].long().tolist()


def _numbered_rows(tmp_path: Path, rows: int = 24) -> Path:
    """Rows whose first feature is their index, so a batch says which rows it holds."""
    path = tmp_path / "rows.pt"
    x = torch.arange(rows, dtype=torch.float32)[:, None].repeat(1, 3)
    torch.save({"x": x, "y": x[:, :1] * 2}, path)
    return path


def test_dataset_consumers_disjoint_and_resume_exact(tmp_path):
    path = _numbered_rows(tmp_path)
    epoch_rows = []
    for rank in range(2):
        it = iter(_rows_dataset(path, rank, 2))
        epoch_rows.append([r for _ in range(3) for r in _row_ids(next(it))])  # 3 x 4 rows: half an epoch
    assert not set(epoch_rows[0]) & set(epoch_rows[1])
    assert sorted(epoch_rows[0] + epoch_rows[1]) == list(range(24))

    dataset = _rows_dataset(path, 1, 2)
    it = iter(dataset)
    for _ in range(5):  # into the second epoch
        next(it)
    state = dataset.state_dict()
    expected = [_row_ids(next(it)) for _ in range(3)]
    resumed = _rows_dataset(path, 1, 2)
    resumed.load_state_dict(state)
    it = iter(resumed)
    assert [_row_ids(next(it)) for _ in range(3)] == expected


def test_dataset_merge_at_new_layout_skips_no_row(tmp_path):
    path = _numbered_rows(tmp_path)
    consumed, states = set(), []
    # Of epoch 0's order rank 0 reads positions 0, 2, 4, 6 (next: 8), rank 1 1, 3, .., 15 (next: 17).
    for rank, batches in ((0, 1), (1, 2)):
        dataset = _rows_dataset(path, rank, 2)
        it = iter(dataset)
        consumed |= {r for _ in range(batches) for r in _row_ids(next(it))}
        states.append({"dataset_state": dataset.state_dict()})  # nested, as a loader's state holds it
    merged = _rows_dataset(path, 0, 2).merge_states(states)
    single = _rows_dataset(path, 0, 1)  # the new layout: one rank
    single.start_from(next(iter(merged.values())))
    it = iter(single)
    rest_of_epoch = [r for _ in range(4) for r in _row_ids(next(it))]  # positions 8..23
    unseen = set(range(24)) - consumed
    assert len(unseen) == 12 and unseen <= set(rest_of_epoch)
    assert len(set(rest_of_epoch) & consumed) == 4  # rank 1's rows past position 8 are seen twice


def test_eval_split_is_one_pass_in_file_order(tmp_path):
    path = _numbered_rows(tmp_path, rows=10)
    batches = [_row_ids(b) for b in _rows_dataset(path, 0, 1, split="eval")]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]



def test_regression_baseline_is_the_variance_of_the_targets():
    load_plugins([str(EXAMPLE / "toy_regression")])
    from toy_regression.task import RegressionTask

    task = RegressionTask(0.0)
    y = torch.tensor([[1.0, 0.0], [3.0, 2.0], [5.0, 4.0]])
    halves = [task.baseline_stats({"y": y[:1]}), task.baseline_stats({"y": y[1:]})]
    baseline = task.baseline_loss(halves[0] + halves[1])
    assert baseline.loss == pytest.approx(float(y.var(0, unbiased=False).sum()))
