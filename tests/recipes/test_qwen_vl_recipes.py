"""The full-size Qwen2.5-VL-7B recipe plans with ``--dry-run``: its parameter count is the published
model's (8,292,166,656, Qwen/Qwen2.5-VL-7B-Instruct), LLM and vision tower apart. Run through the
launcher module with this interpreter (what ``scripts/train.sh --dry-run`` runs after its venv)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.launch.test_launch import REPO

RECIPE = REPO / "recipes" / "qwen2.5-vl" / "qwen2.5_vl_7b.yaml"
PUBLISHED = 8_292_166_656


def _count(pattern: str, text: str) -> int:
    return int(re.search(pattern, text).group(1).replace(",", ""))


def test_7b_recipe_plans_with_the_published_parameter_count(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "veomni.launch", str(RECIPE), "--launcher-world-size", "8",
         "--launch-settings", str(tmp_path / "settings"), "--dry-run", "--world-size", "8", "--gpus"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    total = _count(r"parameters\s+([\d,]+)", out)
    assert abs(total - PUBLISHED) / PUBLISHED < 0.01
    assert _count(r"llm\s+([\d,]+) parameters", out) + _count(r"encoder image\s*([\d,]+) parameters", out) == total
