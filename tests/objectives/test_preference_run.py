"""A preference run end to end in the trainer (one gloo rank): chat_preference data, the DPO
objective with its frozen reference (a sharded copy, or the LoRA base), metrics in every step and at
eval, and the launcher's refusal of a malformed pair before any worker starts (exit 2, file and line)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from harness.gloo_ranks import run_distributed
from tests.chat_utils import write_chat_tokenizer, write_jsonl
from tests.data.test_chat_preference_data import pair
from tests.parity_utils import assert_scalar_parity
from tests.trainer_utils import tiny_run_config
from veomni.config.schema import RunConfig
from veomni.train.trainer import Trainer

PAIR_METRICS = ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy", "logps_chosen",
                "logps_rejected")


def preference_run_config(tmp_path: Path, objective: str = "dpo", lora_rank: int = 0, **train) -> RunConfig:
    tokenizer = write_chat_tokenizer(tmp_path / "tokenizer")
    train_path = write_jsonl(tmp_path / "pairs" / "train.jsonl", [json.dumps(pair(i)) for i in range(40)])
    eval_path = write_jsonl(tmp_path / "pairs" / "eval.jsonl", [json.dumps(pair(i)) for i in range(40, 52)])
    cfg = tiny_run_config(tmp_path, max_steps=3, objective=objective, lr=1e-2, **train)
    cfg.model.options["vocab_size"] = 8256
    cfg.data.kind, cfg.data.format, cfg.data.text_key = "chat_preference", "jsonl", "json"
    cfg.data.train_path, cfg.data.eval_path, cfg.data.tokenizer = str(train_path), str(eval_path), str(tokenizer)
    cfg.data.tokens_per_micro_batch = 256
    cfg.checkpoint.interval = 0
    cfg.lora.rank = lora_rank
    return cfg


def _train(rank: int, world: int, cfg: RunConfig) -> tuple[list[dict], dict]:
    trainer = Trainer(cfg)
    history = trainer.train()
    return history, trainer.last_eval


@pytest.mark.parametrize("lora_rank, world", [(0, 1), (4, 1), pytest.param(0, 2, marks=pytest.mark.full),
                                              pytest.param(4, 2, marks=pytest.mark.full)],
                         ids=["full", "lora", "pp2", "lora-pp2"])
def test_dpo_starts_at_ln2_and_reports_pair_metrics(tmp_path: Path, lora_rank: int, world: int) -> None:
    cfg = preference_run_config(tmp_path, lora_rank=lora_rank, **({"grad_accum": 2} if world > 1 else {}))
    cfg.parallel.pp = world  # 2 ranks: a pipeline, the reference staged beside the policy
    history, last_eval = run_distributed(_train, world, cfg)[0]  # files written once, not per rank
    assert_scalar_parity(history[0]["loss"], math.log(2), "first DPO loss: policy = reference")
    assert history[0]["rewards_margin"] == 0.0
    for metrics in history:
        assert set(PAIR_METRICS) <= set(metrics) and "loss_pairs" in metrics and "loss_tokens" not in metrics
    assert last_eval["eval_loss_pairs"] * 2 == last_eval["eval_samples"] > 0, "eval units are pairs of two halves"
    assert history[-1]["rewards_margin"] != 0.0, "the policy moved away from its reference"
    assert {f"eval_{name}" for name in PAIR_METRICS} <= set(last_eval)
    assert_scalar_parity(last_eval["eval_baseline"], math.log(2), "DPO's indifferent loss")


def test_the_launcher_refuses_a_malformed_pair_before_any_worker(tmp_path: Path, capsys) -> None:
    from veomni.config.load import dump_config
    from veomni.launch import main

    cfg = preference_run_config(tmp_path)
    lines = Path(cfg.data.train_path).read_text().splitlines()
    bad = json.loads(lines[4])
    bad["rejected"] = []
    Path(cfg.data.train_path).write_text("\n".join([*lines[:4], json.dumps(bad), *lines[5:]]) + "\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(dump_config(cfg))
    settings = tmp_path / "settings"
    assert main([str(recipe), "--launch-settings", str(settings)]) == 2
    err = capsys.readouterr()
    text = err.out + err.err
    assert "train.jsonl:5:" in text and "'rejected' is empty" in text, text
    assert not (Path(cfg.train.output_dir) / "config.yaml").exists(), "no worker started"


def _train_rpo(rank: int, world: int, tmp: str, alpha: float) -> tuple[list[dict], dict]:
    cfg = preference_run_config(Path(tmp))
    cfg.preference.rpo_alpha = alpha
    trainer = Trainer(cfg)
    history = trainer.train()
    return history, trainer.last_eval


def test_rpo_alpha_adds_the_chosen_nll_per_token_to_the_dpo_loss(tmp_path: Path) -> None:
    alpha = 0.5
    history, last_eval = run_distributed(_train_rpo, 1, str(tmp_path), alpha)[0]
    first = history[0]
    assert first["nll_chosen"] > 1.0, first
    assert_scalar_parity(first["loss"], math.log(2) + alpha * first["nll_chosen"],
                         "policy = reference: ln 2 plus the NLL term")
    assert "eval_nll_chosen" in last_eval and "eval_baseline" not in last_eval, last_eval
