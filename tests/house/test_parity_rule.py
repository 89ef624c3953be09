"""The parity rule of ``tests/parity_utils.py`` passes fp32 rounding and fails real errors.

A real record (one step of the tiny LLM on one gloo rank) is compared with copies of itself:
copies moved by a few rounding steps, as another summation order moves them, must pass; copies
with an error of 1e-4 relative planted in the loss, in one whole gradient, in a single element
of a gradient or in a parameter must fail. The pair of losses that failed the old absolute
tolerance on a CI-class machine (issue 33: one fp32 step apart at 8.98) passes.
"""

from __future__ import annotations

import copy

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.parity_utils import (
    FP32_EPS,
    assert_parity,
    assert_records_close,
    assert_scalar_parity,
    run_steps,
    sample_lengths,
)

PLANTED = 1e-4


def _one_step(rank, world):
    return run_steps([[sample_lengths(6)]])


@pytest.fixture(scope="module")
def record() -> dict:
    return run_distributed(_one_step, 1)[0]


def _rounded(tensor: torch.Tensor, steps: float, seed: int) -> torch.Tensor:
    """``tensor`` with every element moved by up to ``steps`` fp32 rounding steps of the tensor's scale."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.rand(tensor.shape, generator=gen, dtype=torch.float64) * 2 - 1
    scale = tensor.abs().max().double()
    return (tensor.double() + noise * steps * FP32_EPS * scale).to(tensor.dtype)


def test_rounding_differences_pass(record):
    moved = copy.deepcopy(record)
    moved["loss"] = [loss * (1 + 8 * FP32_EPS) for loss in record["loss"]]
    for i, grads in enumerate(moved["grads"]):
        moved["grads"][i] = {name: _rounded(g, 8, seed) for seed, (name, g) in enumerate(grads.items())}
    moved["params"] = {name: _rounded(p, 8, seed) for seed, (name, p) in enumerate(record["params"].items())}
    assert_records_close(record, moved)


def test_the_losses_that_failed_on_a_ci_class_machine_pass():
    assert_scalar_parity(8.980998992919922, 8.980997903006417, "omni fsdp2 step 0 loss")
    assert_scalar_parity(8.377456937517438, 8.377455575125557, "long-short dp2 step 1 loss")


def _planted_loss(rec):
    rec["loss"][0] *= 1 + PLANTED


def _planted_whole_gradient(rec):
    name = next(iter(rec["grads"][0]))
    rec["grads"][0][name] = rec["grads"][0][name] * (1 + PLANTED)


def _planted_one_element(rec):
    name = "layers.1.mlp.down_proj.weight"
    grad = rec["grads"][0][name].clone()
    grad.view(-1)[grad.numel() // 2] += PLANTED * grad.abs().max()
    rec["grads"][0][name] = grad


def _planted_parameter(rec):
    name = "norm.weight"
    rec["params"][name] = rec["params"][name] * (1 + PLANTED)


@pytest.mark.parametrize("plant", [_planted_loss, _planted_whole_gradient, _planted_one_element,
                                   _planted_parameter], ids=["loss", "whole-gradient", "one-element", "parameter"])
def test_a_planted_error_of_1e_4_relative_fails(record, plant):
    planted = copy.deepcopy(record)
    plant(planted)
    with pytest.raises(AssertionError, match="fp32 steps of the reference"):
        assert_records_close(record, planted)


def test_a_zero_reference_admits_only_zero():
    zeros = torch.zeros(4)
    assert_parity(zeros.clone(), zeros, "padding gradient")
    with pytest.raises(AssertionError):
        assert_parity(torch.tensor([0.0, 1e-6, 0.0, 0.0]), zeros, "padding gradient")


@pytest.mark.parametrize("key", ["loss", "metrics", "grads"])
def test_a_record_with_fewer_steps_fails(record, key):
    """``zip`` would pair the steps both runs made and pass a run that stopped early (issue 47)."""
    short = copy.deepcopy(record)
    short[key] = short[key][:-1]
    with pytest.raises(AssertionError, match=f"{key}: 0 steps recorded vs 1 in the reference"):
        assert_records_close(record, short)
