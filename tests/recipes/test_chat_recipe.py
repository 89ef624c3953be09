"""The chat SFT recipe end to end: ``data.prepare`` builds a small set and its chat tokenizer, the
tiny decoder trains a few steps on 2 CPU processes with ``--parallel.sp 2`` (both ranks slice each
row of conversations), the summary reports an assistant-only eval loss against its baseline, and
the exact-match command scores the checkpoint it leaves; a recipe whose tokenizer has no chat
template stops in the launcher, before any worker starts."""

from __future__ import annotations

import json
import math

import pytest

from tests.launch.test_launch import REPO, train_sh
from veomni.eval.chat_exact_match import main as chat_exact_match

pytestmark = pytest.mark.full  # whole runs: the full tier (tests/conftest.py)

RECIPE = REPO / "recipes" / "chat" / "tiny_chat_sft.yaml"


def test_tiny_chat_recipe_trains_with_sp2_and_the_eval_command_scores_it(tmp_path, capsys):
    data, out = tmp_path / "chat", tmp_path / "out"
    result = train_sh(str(RECIPE), "--parallel.sp", "2",
                      "--data.train_path", str(data / "train"), "--data.eval_path", str(data / "eval"),
                      "--data.tokenizer", str(data / "tokenizer"),
                      "--data.prepare_args", '["--train-samples", "400", "--eval-samples", "40"]',
                      "--train.max_steps", "4", "--train.eval_interval", "0", "--train.output_dir", str(out),
                      "--checkpoint.interval", "0", "--log.progress_bar", "false", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sp=2 (Ulysses)" in result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert math.isfinite(summary["eval_loss"]) and summary["baseline"]["loss"] > 0, summary
    capsys.readouterr()  # the command in this process (python -m veomni.eval.chat_exact_match without its start)
    status = chat_exact_match([str(out), "--limit", "10"])
    scored = capsys.readouterr()
    assert status == 0, scored.err[-3000:]
    assert "exact match of greedy answers on 10 held-out conversations" in scored.out


def test_a_tokenizer_without_chat_template_stops_the_launcher(tmp_path):
    result = train_sh(str(RECIPE), "--data.tokenizer", str(REPO / "data" / "tokenizers" / "stdlib-bpe-8k"),
                      "--data.train_path", str(tmp_path / "chat" / "train"),
                      "--data.eval_path", str(tmp_path / "chat" / "eval"),
                      "--data.prepare_args", '["--train-samples", "40", "--eval-samples", "10"]')
    assert result.returncode == 2, result.stderr[-3000:]
    assert "has no chat template" in result.stderr and "stdlib-bpe-8k" in result.stderr
    assert "process(es)" not in result.stderr, "workers were launched"
