"""The DPO recipe end to end: ``recipes/preference/tiny_chat_dpo.yaml`` as written (its model, its
objective with the chosen reply's NLL term, its data builder on a small set) trains a few steps on
2 CPU processes from a start model given as a Hugging Face folder, the summary reports the held-out
pair metrics, and the exact-match command scores the run's greedy answers against each pair's two
replies, beside the same scores of the start model (the baseline the README's figures compare with).

The start here is a random model of the recipe's shape, not the chat SFT model that the recipe's
``checkpoint.prepare`` trains (minutes): the test holds the wiring, the README holds the figures."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from tests.launch.test_launch import REPO, train_sh
from veomni.checkpoint.hf_io import save_hf_pretrained
from veomni.contract import build_model
from veomni.eval.chat_exact_match import main as chat_exact_match

pytestmark = pytest.mark.full  # a whole run: the full tier (tests/conftest.py)

RECIPE = REPO / "recipes" / "preference" / "tiny_chat_dpo.yaml"


def test_dpo_recipe_trains_and_the_eval_scores_it_against_its_start(tmp_path, capsys):
    recipe = yaml.safe_load(RECIPE.read_text())
    assert recipe["preference"]["rpo_alpha"] > 0 and recipe["train"]["objective"] == "dpo"
    options = {k: v for k, v in recipe["model"].items() if k != "arch"}
    torch.manual_seed(0)
    config, model = build_model(recipe["model"]["arch"], options)
    start = save_hf_pretrained(recipe["model"]["arch"], config, model.state_dict(), tmp_path / "start")
    data, out = tmp_path / "pairs", tmp_path / "out"
    result = train_sh(str(RECIPE), "--checkpoint.init_from_hf", str(start),
                      "--data.train_path", str(data / "train"), "--data.eval_path", str(data / "eval"),
                      "--data.tokenizer", str(data / "tokenizer"),
                      "--data.prepare_args", '["--train-samples", "200", "--eval-samples", "16"]',
                      "--train.max_steps", "3", "--train.warmup_steps", "1", "--train.eval_interval", "0",
                      "--train.output_dir", str(out), "--checkpoint.interval", "0", "--log.progress_bar", "false",
                      timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    metrics = summary["eval_metrics"]
    assert 0 <= metrics["rewards_accuracy"] <= 1 and metrics["nll_chosen"] > 0, summary
    capsys.readouterr()  # the command in this process (python -m veomni.eval.chat_exact_match without its start)
    status = chat_exact_match([str(out), "--limit", "8", "--max-answer-tokens", "4", "--json",
                               str(tmp_path / "scores.json")])
    scored = capsys.readouterr()
    assert status == 0, scored.err[-3000:]
    scores = json.loads((tmp_path / "scores.json").read_text())
    assert scores["conversations"] == 8 and scores["start_model"] == str(start), scores
    assert {"accuracy", "rejected"} <= set(scores) and {"accuracy", "rejected"} == set(scores["start"]), scores
    assert "= the chosen reply" in scored.out and "the run's checkpoint.init_from_hf" in scored.out
