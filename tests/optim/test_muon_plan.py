"""The owner plan: LPT against the best assignment found by exhaustive search on small sets, and
the balance at 64 ranks for the Qwen3 recipes (``--dry-run``'s lines)."""

import contextlib
import io
import itertools

import pytest
import torch

from veomni.config.load import load_config
from veomni.contract import build_model, get_model_spec
from veomni.launch import main as launch
from veomni.optim.muon_plan import ns_flops, plan_owners
from veomni.optim.muon_report import muon_loads
from veomni.parallel.mesh import ParallelDims


@pytest.mark.parametrize("costs,ranks", [([5, 4, 3, 3, 3], 2), ([7, 7, 6, 5, 4, 4, 2, 1], 3), ([9, 1, 1, 1], 2)])
def test_lpt_is_within_four_thirds_of_the_best_assignment(costs, ranks):
    plan = plan_owners(costs, ranks)
    assert sorted(plan.loads) == sorted(sum(c for c, o in zip(costs, plan.owners) if o == r) for r in range(ranks))
    best = min(max(sum(c for c, o in zip(costs, owners) if o == r) for r in range(ranks))
               for owners in itertools.product(range(ranks), repeat=len(costs)))
    assert max(plan.loads) <= (4 / 3 - 1 / (3 * ranks)) * best + 1e-9


def test_ns_flops_counts_the_quintic():
    """One iteration on a wide s x l matrix: X X^T (s s l), the polynomial's square (s s s) and its
    product with X (s s l), two FLOPs per multiply-add."""
    assert ns_flops(4, 10, steps=1) == 2 * (4 * 4 * 10) + 2 * 4 ** 3 + 2 * (4 * 4 * 10)
    assert ns_flops(10, 4, steps=5) == ns_flops(4, 10, steps=5)


def _balance(recipe: str, world: int) -> float:
    cfg = load_config(recipe, ["--train.optimizer", "muon"])
    dims = ParallelDims.resolve(cfg.parallel, world)
    with torch.device("meta"):
        model_cfg, model = build_model(cfg.model.arch, cfg.model.options)
    loads, _ = muon_loads(model, cfg, dims.shard_size, dims.ep, get_model_spec(cfg.model.arch).param_rules(model_cfg))
    return max(loads) / (sum(loads) / len(loads))


def test_qwen3_30b_a3b_at_64_ranks_meets_the_balance_goal():
    assert _balance("recipes/qwen3-moe/qwen3_30b_a3b.yaml", 64) <= 1.05


def test_qwen3_8b_at_64_ranks_is_at_the_whole_matrix_optimum():
    """36 layers x (q, o: 6 units; gate, up, down: 14; k, v: 0.28 of 4096^3 x 5 FLOPs): the mean per
    rank is 30.7 units and no whole-matrix assignment keeps every rank under 2 MLP + 1 q/o (34,
    1.108) -- the 108 MLP matrices force 44 ranks to hold two of them or the q/o ones overflow
    elsewhere. So 1.108 is the best any owner-per-matrix plan reaches; 1.05 needs a matrix's
    iteration split over ranks (docs/optimizers.md)."""
    assert _balance("recipes/qwen3/qwen3_8b.yaml", 64) == pytest.approx(34 / (36 * 54.5625 / 64), rel=1e-3)


def test_dry_run_prints_the_plan():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert launch(["recipes/qwen3-moe/qwen3_30b_a3b.yaml", "--dry-run", "--world-size", "64", "--gpus",
                       "--train.optimizer", "muon"]) == 0
    assert "muon owner plan (64 ranks per shard group, ep=8)" in out.getvalue()
    assert "muon gathers + scatters:" in out.getvalue()
