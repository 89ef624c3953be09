"""The Qwen2.5-VL recipes plan with ``--dry-run``: the full-size ones at the published parameter counts
(7B: 8,292,166,656, Qwen/Qwen2.5-VL-7B-Instruct; 72B: within 1% of 73.4B, Qwen/Qwen2.5-VL-72B-Instruct),
LLM and vision tower apart, with the memory per rank at 64 GPUs; the tiny one from its random
Hugging Face folder (whose options the launcher compares with the recipe's) or, when the folder is
absent, saying that the run builds it first; the tiny video recipe (our own initialisation) at tiny's
parameter count, saying that the run builds its data first. Planned by the launcher's ``main`` in this
process (what ``scripts/train.sh --dry-run`` runs after its venv, without an interpreter start per
plan). The tiny video recipe also trains
a few steps through ``scripts/train.sh`` on a small build of the video QA set, and the VQA eval scores
its checkpoint (full tier)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from tests.launch.test_launch import REPO, train_sh
from tests.omni_utils import qwen_vl_random_builder
from veomni import launch

RECIPES = REPO / "recipes" / "qwen2.5-vl"
PUBLISHED_7B = 8_292_166_656
PUBLISHED_72B = 73.4e9
GPU_MEMORY_GIB = 80


def _count(pattern: str, text: str) -> float:
    return float(re.search(pattern, text).group(1).replace(",", ""))


def _dry_run(capsys, recipe: str, world: int, *extra: str, gpus: bool = True) -> str:
    status = launch.main([str(RECIPES / recipe), "--dry-run", "--world-size", str(world),
                          *(["--gpus"] if gpus else []), *extra])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    return captured.out + captured.err


def _check_counts(out: str, published: float, exact: bool) -> None:
    total = _count(r"parameters\s+([\d,]+)", out)
    assert total == published if exact else abs(total - published) / published < 0.01
    assert _count(r"llm\s+([\d,]+) parameters", out) + _count(r"encoder image\s*([\d,]+) parameters", out) == total


@pytest.mark.parametrize("world", [8, 64])
def test_7b_recipe_plans_with_the_published_parameter_count(world, capsys):
    out = _dry_run(capsys, "qwen2.5_vl_7b.yaml", world)
    _check_counts(out, PUBLISHED_7B, exact=True)
    assert f"world={world}" in out
    assert 0 < _count(r"memory / rank[^\n]*\n(?:.*\n)*?\s+total\s+([\d.]+)", out) < GPU_MEMORY_GIB


def test_72b_recipe_plans_within_one_percent_of_the_published_count_at_64_gpus(capsys):
    out = _dry_run(capsys, "qwen2.5_vl_72b.yaml", 64)
    _check_counts(out, PUBLISHED_72B, exact=False)
    assert "world=64" in out and "sp=4" in out
    assert 0 < _count(r"memory / rank[^\n]*\n(?:.*\n)*?\s+total\s+([\d.]+)", out) < GPU_MEMORY_GIB


def test_tiny_recipe_plans_from_its_random_folder(tmp_path, capsys):
    folder = tmp_path / "random"
    out = _dry_run(capsys, "tiny.yaml", 2, "--checkpoint.init_from_hf", str(folder), gpus=False)
    assert "the run builds checkpoint.init_from_hf" in out and "build_qwen_vl_random.py" in out
    qwen_vl_random_builder().main(["--out", str(folder)])
    out = _dry_run(capsys, "tiny.yaml", 2, "--checkpoint.init_from_hf", str(folder), gpus=False)
    assert "the run builds checkpoint.init_from_hf" not in out  # the folder exists: its config was compared
    _check_counts(out, 3_645_024, exact=True)  # the folder's parameters, every one of them


def test_prepare_without_its_folder_is_refused(capsys):
    status = launch.main([str(RECIPES / "tiny.yaml"), "--dry-run", "--world-size", "2",
                          "--checkpoint.init_from_hf", "null"])
    assert status == 2
    assert "checkpoint.prepare builds checkpoint.init_from_hf, which is not set" in capsys.readouterr().err


def test_tiny_video_recipe_plans_and_says_it_builds_its_data_first(tmp_path, capsys):
    videos = tmp_path / "video_qa"
    out = _dry_run(capsys, "tiny_video.yaml", 2, "--data.train_path", str(videos / "train"), "--data.eval_path",
                   str(videos / "eval"), gpus=False)
    assert "the run builds data.train_path, data.eval_path first with build_video_qa.py" in out
    _check_counts(out, 3_645_024, exact=True)  # tiny.yaml's dimensions


@pytest.mark.full  # a whole run through scripts/train.sh: the full tier (tests/conftest.py)
def test_tiny_video_recipe_trains_and_the_vqa_eval_scores_it(tmp_path):
    videos, out = tmp_path / "video_qa", tmp_path / "out"
    subprocess.run([sys.executable, str(REPO / "data" / "build_video_qa.py"), "--train-out", str(videos / "train"),
                    "--eval-out", str(videos / "eval"), "--train-samples", "64", "--eval-samples", "16"],
                   cwd=REPO, check=True, capture_output=True, timeout=120)
    result = train_sh(str(RECIPES / "tiny_video.yaml"), "--data.train_path", str(videos / "train"),
                      "--data.eval_path", str(videos / "eval"),
                      "--train.max_steps", "3", "--train.output_dir", str(out), "--train.eval_interval", "0",
                      "--train.eval_batches", "1", "--checkpoint.interval", "0", "--log.progress_bar", "false",
                      timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-1] == 3
    assert all(math.isfinite(r["loss"]) for r in records if "loss" in r)
    scored = subprocess.run(["bash", str(REPO / "scripts" / "eval_vqa.sh"), str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert scored.returncode == 0, scored.stderr[-3000:]
    table = {line.split()[0]: line.split()[1:] for line in scored.stdout.splitlines()[1:]}
    assert set(table) == {"direction", "color", "shape", "all"} and table["all"][0] == "16"
