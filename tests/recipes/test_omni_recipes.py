"""The Seed1.5-VL recipes: the tiny one trains a few steps on 2 CPU processes from a small VQA
build and the eval command scores its checkpoint; the full-size one plans at 256 ranks; the
VQA builder is deterministic and reports its majority baseline."""

from __future__ import annotations

import json
import math
import re
import subprocess

import pytest

from tests.launch.test_launch import REPO, dry_run, train_sh
from tests.omni_utils import build_vqa
from veomni.data.sources import ReadStats, iter_tar_samples, resolve_files

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

RECIPES = REPO / "recipes" / "seed1.5-vl"


def test_vqa_builder_is_deterministic_and_reports_the_baseline(tmp_path):
    first = build_vqa(tmp_path / "a", 100, 50)
    build_vqa(tmp_path / "b", 100, 50)
    assert "majority-class baseline" in first and "cached" in build_vqa(tmp_path / "a", 100, 50)
    for split in ("train", "eval"):  # same records (tar headers carry the write time)
        a, b = (
            list(iter_tar_samples(resolve_files(str(tmp_path / x / split))[1], 0.0, ReadStats()))
            for x in ("a", "b")
        )
        assert len(a) == (100 if split == "train" else 50)
        assert [{k: v for k, v in r.items() if k != "__url__"} for r in a] == [
            {k: v for k, v in r.items() if k != "__url__"} for r in b
        ]
    manifest = json.loads((tmp_path / "a" / "eval" / "manifest.json").read_text())
    assert set(manifest["majority_baseline"]) == {"color", "shape", "count", "position", "size"}


def test_tiny_recipe_trains_with_sequence_parallelism_and_the_eval_command_scores_it(tmp_path, vqa_build):
    """``--parallel.sp 2`` on 2 ranks: both split each row and the images' features reach the
    slices; the checkpoint it leaves is scored like any other."""
    out = tmp_path / "out"
    result = train_sh(
        str(RECIPES / "tiny.yaml"),
        "--parallel.sp",
        "2",
        "--data.train_path",
        str(vqa_build / "train"),
        "--data.eval_path",
        str(vqa_build / "eval"),
        "--train.max_steps",
        "4",
        "--train.output_dir",
        str(out),
        "--train.eval_interval",
        "0",
        "--train.eval_batches",
        "1",
        "--checkpoint.interval",
        "0",
        "--log.progress_bar",
        "false",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sp=2 (Ulysses)" in result.stdout + result.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-1] == 4
    assert all(math.isfinite(r["loss"]) for r in records if "loss" in r)
    assert any("eval_answer_token_acc" in r for r in records)
    scored = subprocess.run(
        ["bash", str(REPO / "scripts" / "eval_vqa.sh"), str(out), "--limit", "20"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert scored.returncode == 0, scored.stderr[-3000:]
    table = {line.split()[0]: line.split()[1:] for line in scored.stdout.splitlines()[1:]}
    assert table["all"][0] == "20" and set(table) - {"all"} <= {"color", "shape", "count", "position", "size"}


def test_full_size_recipe_plans_at_256_ranks(capfd):
    result = dry_run(capfd, str(RECIPES / "seed1.5_vl.yaml"), "--world-size", "256", "--gpus")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    llm_active = int(re.search(r"llm\s+[\d,]+ parameters, ([\d,]+) activated", out).group(1).replace(",", ""))
    assert abs(llm_active - 20e9) / 20e9 < 0.05  # the published 20B activated
    vit = int(re.search(r"encoder image\s*([\d,]+) parameters", out).group(1).replace(",", ""))
    assert abs(vit - 532e6) / 532e6 < 0.03  # the published 532M (shape assumed)
    assert "ep=8" in out


def test_context_parallelism_is_refused_before_workers_start(capfd):
    result = dry_run(capfd, str(RECIPES / "tiny.yaml"), "--parallel.cp", "2")
    assert result.returncode != 0
    assert "context parallelism is not supported for models with encoders" in result.stdout + result.stderr
