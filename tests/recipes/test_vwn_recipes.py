"""The VWN recipes: the full-size one plans with --dry-run and reports the virtual-width
overhead; the sweep points differ only in their virtual width; the sweep's fit and outputs."""

from __future__ import annotations

import re

import pytest

from tests.launch.test_launch import REPO, dry_run
from veomni.config.load import config_to_dict, load_config
from veomni.contract import build_config
from veomni.data.builders import load_script

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

SWEEP = ["baseline", "r1p5", "r2", "r4", "r8"]


def test_full_size_recipe_dry_run_reports_virtual_width_overhead(capfd):
    recipe = REPO / "recipes" / "vwn" / "vwn_r8_4b.yaml"
    result = dry_run(capfd, str(recipe), "--world-size", "64", "--gpus")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "r = n/m = 8 (m=8, n=64)" in out and "D'=20480" in out
    backbone = int(re.search(r"parameters: backbone ([\d,]+)", out).group(1).replace(",", ""))
    assert abs(backbone - 4.02e9) / 4.02e9 < 0.01  # the assumed dense Qwen3-4B backbone
    overhead = float(re.search(r"FLOPs/token: .* virtual width \+[\d.]+ G \(\+([\d.]+)%\)", out).group(1))
    assert 0 < overhead < 10


def test_full_size_moe_recipe_dry_run_counts_activated_experts(capfd):
    """The paper's MoE-A3.3B setting over the (assumed) Qwen3-30B-A3B backbone, experts split 8-way."""
    result = dry_run(capfd, str(REPO / "recipes" / "vwn" / "vwn_r8_moe_a3b.yaml"), "--world-size", "64",
                     "--gpus")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "ep=8" in out and "r = n/m = 8 (m=8, n=64)" in out
    backbone = int(re.search(r"parameters: backbone ([\d,]+)", out).group(1).replace(",", ""))
    assert backbone == 30_532_122_624  # Qwen3-30B-A3B's count (recipes/qwen3-moe, tests/models/test_moe_config.py)
    total = int(re.search(r"parameters +([\d,]+)", out).group(1).replace(",", ""))
    activated = int(re.search(r"activated +([\d,]+)", out).group(1).replace(",", ""))
    assert 3.3e9 < activated < 0.15 * total  # 8 of 128 experts per layer, hyper-connections all active


def test_sweep_points_differ_only_in_virtual_width():
    configs = {name: config_to_dict(load_config(REPO / "recipes" / "vwn" / f"sweep_{name}.yaml"))
               for name in SWEEP}
    base = configs["baseline"]
    vwn_keys = {"vwn_m", "vwn_n", "hyper_connections"}
    for name, cfg in configs.items():
        assert {k for k in cfg["model"] if cfg["model"].get(k) != base["model"].get(k)} <= vwn_keys, name
        for section in ("data", "parallel", "checkpoint", "log"):
            assert cfg[section] == base[section], (name, section)
        assert {k: v for k, v in cfg["train"].items() if k != "output_dir"} == \
            {k: v for k, v in base["train"].items() if k != "output_dir"}
        assert cfg["model"]["mtp"] is True
    factors = [build_config("vwn", {k: v for k, v in c["model"].items() if k != "arch"}).virtual_width_factor
               for c in configs.values()]
    assert [float(r) for r in factors] == [1, 1.5, 2, 4, 8]


@pytest.fixture(scope="module")
def sweep():
    return load_script(REPO / "scripts" / "vwn_sweep.py")


def test_sweep_fit_recovers_a_log_linear_law(sweep):
    xs = [0, 1, 2, 3]
    slope, intercept, r2 = sweep.fit(xs, [1.6212 - 0.0069 * x for x in xs])
    assert slope == pytest.approx(-0.0069) and intercept == pytest.approx(1.6212) and r2 == pytest.approx(1.0)
    assert sweep.fit(xs, [1.0, 2.0, 1.0, 2.0])[2] < 0.5


def test_sweep_summary_writes_table_and_plots(sweep, tmp_path):
    runs = [{"name": name, "m": 2, "n": int(2 * r), "r": r, "params": 1000, "flops_per_token": 1e6,
             "tokens_seen": 2048, "wall_s": 1.0, "train_ntp": 5.0, "train_mtp": 5.5,
             "eval_ntp": 5.0 - 0.01 * i,
             "eval_mtp": 6.0 - 0.02 * i, "curve_tokens": [1024, 2048], "curve_ntp": [6.0, 5.0],
             "curve_mtp": [7.0, 6.0]} for i, (name, r) in enumerate(zip(SWEEP, [1, 1.5, 2, 4, 8]))]
    table = sweep.summarise(runs, tmp_path)
    assert "| r8 | (2, 16) | 8 |" in table and table.count("R^2") == 4
    for png in ("loss_vs_tokens_ntp.png", "loss_vs_tokens_mtp.png", "final_loss_vs_log2r.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
