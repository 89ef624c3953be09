"""MoE configuration: bad expert-parallel layouts fail at config time with a clear message;
the Qwen3-30B-A3B recipe has the real model's parameter count and plans with --dry-run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from models.llm import hf_adapter
from veomni.contract import build_config, build_model
from veomni.launch import main as launch_main

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "qwen3-moe" / "tiny.yaml"
BIG = REPO / "recipes" / "qwen3-moe" / "qwen3_30b_a3b.yaml"


@pytest.mark.parametrize("world, args, needle", [
    (4, ["--parallel.ep", "3"],
     "parallel.ep=3 must be >= 1 and divide the parameter-sharding ranks dp_shard x cp x sp = 4"),
    (6, ["--parallel.ep", "3"], "parallel.ep=3 does not divide the 8 experts of"),
    (2, ["--parallel.ep", "2", "--model.num_experts", "0"], "parallel.ep=2 needs a mixture-of-experts model"),
    (4, ["--parallel.ep", "2", "--parallel.dp_replicate", "2"], "not supported yet"),
], ids=["ep-vs-world", "ep-vs-experts", "ep-dense", "ep-hsdp"])
def test_bad_expert_layout_fails_at_config_time(world, args, needle, capsys):
    assert launch_main([str(TINY), "--dry-run", "--world-size", str(world), *args]) == 2
    captured = capsys.readouterr()
    assert needle in captured.err + captured.out


@pytest.mark.parametrize("options, needle", [
    ({"num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"num_experts": 4, "num_experts_per_tok": 2, "router_scoring": "relu"}, "router_scoring"),
    ({"num_experts": 4, "num_experts_per_tok": 2, "shared_expert_gate": True},
     "shared_expert_gate needs a shared expert"),
    ({"num_experts": 4, "num_experts_per_tok": 2, "capacity_factor": -1.0}, "capacity_factor"),
])
def test_bad_moe_options_are_rejected(options, needle):
    with pytest.raises(ValueError, match=needle):
        build_config("llm", options)


def test_qwen3_30b_a3b_matches_transformers_and_plans(capsys):
    import yaml

    options = {k: v for k, v in yaml.safe_load(BIG.read_text())["model"].items() if k != "arch"}
    with torch.device("meta"):
        cfg, model = build_model("llm", options)
        hf = transformers.Qwen3MoeForCausalLM(hf_adapter.config_to_hf(cfg))
    assert model.num_params() == sum(p.numel() for p in hf.parameters())
    assert abs(model.num_params() - 30.5e9) / 30.5e9 < 0.01
    assert abs(model.activated_params() - 3.3e9) / 3.3e9 < 0.03
    assert launch_main([str(BIG), "--dry-run", "--world-size", "64", "--gpus"]) == 0
    out = capsys.readouterr().out
    assert "ep=8 (experts split 8-way, each slice FSDP-sharded 8-way)" in out
    assert "activated     3,353,032,704" in out


def test_tiny_moe_recipe_trains_with_expert_parallelism(tmp_path):
    """The recipe as a user runs it: 2 processes, experts split 2-way, metrics in the stream."""
    import json
    import os
    import subprocess

    env = {**os.environ, "NPROC_PER_NODE": "2"}
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "train.sh"), str(TINY), "--train.max_steps", "2",
         "--train.output_dir", str(tmp_path / "out"), "--train.sample_prompt", "null", "--train.eval_batches", "1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ep=2 (experts split 2-way" in result.stderr
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 2 and all(len(r["moe/tokens_per_expert"]) == 4 for r in steps)
    assert all(r["moe/aux_loss"] > 0 and r["moe/load_max_over_mean"] >= 1 for r in steps)
