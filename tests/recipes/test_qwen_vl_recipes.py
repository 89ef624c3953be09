"""The Qwen2.5-VL recipes plan with ``--dry-run``: the full-size ones at the published parameter counts
(7B: 8,292,166,656, Qwen/Qwen2.5-VL-7B-Instruct; 72B: within 1% of 73.4B, Qwen/Qwen2.5-VL-72B-Instruct),
LLM and vision tower apart, with the memory per rank at 64 GPUs; the tiny one from its random
Hugging Face folder (whose options the launcher compares with the recipe's) or, when the folder is
absent, saying that the run builds it first. Run through the launcher module with this interpreter
(what ``scripts/train.sh --dry-run`` runs after its venv)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.launch.test_launch import REPO

RECIPES = REPO / "recipes" / "qwen2.5-vl"
PUBLISHED_7B = 8_292_166_656
PUBLISHED_72B = 73.4e9
GPU_MEMORY_GIB = 80


def _count(pattern: str, text: str) -> float:
    return float(re.search(pattern, text).group(1).replace(",", ""))


def _dry_run(recipe: str, world: int, *extra: str, gpus: bool = True) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "veomni.launch", str(RECIPES / recipe), "--dry-run", "--world-size", str(world),
         *(["--gpus"] if gpus else []), *extra], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


def _check_counts(out: str, published: float, exact: bool) -> None:
    total = _count(r"parameters\s+([\d,]+)", out)
    assert total == published if exact else abs(total - published) / published < 0.01
    assert _count(r"llm\s+([\d,]+) parameters", out) + _count(r"encoder image\s*([\d,]+) parameters", out) == total


@pytest.mark.parametrize("world", [8, 64])
def test_7b_recipe_plans_with_the_published_parameter_count(world):
    out = _dry_run("qwen2.5_vl_7b.yaml", world)
    _check_counts(out, PUBLISHED_7B, exact=True)
    assert f"world={world}" in out
    assert 0 < _count(r"memory / rank[^\n]*\n(?:.*\n)*?\s+total\s+([\d.]+)", out) < GPU_MEMORY_GIB


def test_72b_recipe_plans_within_one_percent_of_the_published_count_at_64_gpus():
    out = _dry_run("qwen2.5_vl_72b.yaml", 64)
    _check_counts(out, PUBLISHED_72B, exact=False)
    assert "world=64" in out and "sp=4" in out
    assert 0 < _count(r"memory / rank[^\n]*\n(?:.*\n)*?\s+total\s+([\d.]+)", out) < GPU_MEMORY_GIB


def test_tiny_recipe_plans_from_its_random_folder(tmp_path):
    folder = tmp_path / "random"
    out = _dry_run("tiny.yaml", 2, "--checkpoint.init_from_hf", str(folder), gpus=False)
    assert "the run builds checkpoint.init_from_hf" in out and "build_qwen_vl_random.py" in out
    subprocess.run([sys.executable, str(REPO / "data" / "build_qwen_vl_random.py"), "--out", str(folder)],
                   cwd=REPO, check=True, capture_output=True, timeout=300)
    out = _dry_run("tiny.yaml", 2, "--checkpoint.init_from_hf", str(folder), gpus=False)
    assert "the run builds checkpoint.init_from_hf" not in out  # the folder exists: its config was compared
    _check_counts(out, 3_645_024, exact=True)  # the folder's parameters, every one of them


def test_prepare_without_its_folder_is_refused():
    result = subprocess.run(
        [sys.executable, "-m", "veomni.launch", str(RECIPES / "tiny.yaml"), "--dry-run", "--world-size", "2",
         "--checkpoint.init_from_hf", "null"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "checkpoint.prepare builds checkpoint.init_from_hf, which is not set" in result.stderr
