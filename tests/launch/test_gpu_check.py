"""``scripts/gpu_check.py`` runs here at tiny sizes, so the GPU check cannot rot while no GPU is
at hand: its model-level parts build our models and transformers' / diffusers' from one config,
compare their outputs before timing, and report every figure in one JSON; a part that fails is
recorded and the others still run; an unknown part is refused before anything runs. (The parts
through ``train.sh`` run the same launcher the launch tests cover.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "scripts" / "gpu_check.py"


def _check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), "--tiny", "--out", str(tmp_path), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=600)


def test_model_level_parts_run_compare_and_report(tmp_path):
    done = _check(tmp_path, "--only", "llm_reference,dit_7800,dit_32760,moe")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["machine"]["tiny"] and report["machine"]["torch"]
    results = report["results"]
    assert results["llm_reference"]["tokens_per_s"] > 0 and results["llm_reference"]["mfu"] > 0
    for part in ("dit_7800", "dit_32760"):
        assert results[part]["fp32_rel_l2"] < 1e-5, "the same weights give the same video prediction"
        assert results[part]["ours"]["step_s"] > 0 and results[part]["reference"]["step_s"] > 0
    assert abs(results["moe"]["loss_ours"] - results["moe"]["loss_reference"]) < 1e-5
    assert set(report["ratios"]) == {"dit_7800 ours / reference", "dit_32760 ours / reference",
                                     "moe ours / reference"}
    assert "moe ours / reference" in done.stdout


def test_a_part_past_its_budget_is_killed_reported_and_the_rest_still_run(tmp_path):
    done = _check(tmp_path, "--only", "quickstart,moe", "--budget", "2")
    report = json.loads((tmp_path / "report.json").read_text())
    assert done.returncode == 1 and "FAILED: quickstart" in done.stdout
    assert "past the part's budget of 2 s" in report["results"]["quickstart"]["error"]
    assert "error" not in report["results"]["moe"]
    survivors = subprocess.run(["pgrep", "-f", str(tmp_path / "quickstart")], capture_output=True, text=True)
    assert survivors.stdout == "", "the killed run's launcher and workers are gone"


def test_an_unknown_part_is_refused_before_anything_runs(tmp_path):
    done = _check(tmp_path, "--only", "moe,dit_9000")
    assert done.returncode == 2 and "unknown part(s) ['dit_9000']" in done.stderr
    assert not (tmp_path / "report.json").exists()
