"""The preference losses against their papers' formulas where TRL 1.16 has no counterpart (DPO's
conservative label smoothing: its sigmoid loss dropped it), and the indifferent losses the eval
baseline reports."""

from __future__ import annotations

import math

import torch

from tests.parity_utils import assert_parity, assert_scalar_parity
from veomni.objectives.preference_loss import (
    PairLogps,
    PreferenceOptions,
    dpo_loss,
    indifferent_loss,
    ipo_loss,
    simpo_loss,
)


def _pairs() -> PairLogps:
    gen = torch.Generator().manual_seed(0)
    logps = -torch.rand(6, 3, generator=gen, dtype=torch.float64) * 40
    return PairLogps(logps[0], logps[1], torch.tensor([3.0, 7.0, 5.0], dtype=torch.float64),
                     torch.tensor([4.0, 2.0, 9.0], dtype=torch.float64), logps[2], logps[3])


def test_dpo_with_label_smoothing_is_conservative_dpo() -> None:
    """Mitchell 2023: the chosen reply is preferred with probability 1 - eps."""
    pairs, options = _pairs(), PreferenceOptions(beta=0.3, label_smoothing=0.2)
    z = 0.3 * ((pairs.chosen - pairs.ref_chosen) - (pairs.rejected - pairs.ref_rejected))
    p = 1 / (1 + torch.exp(-z))
    expected = -0.8 * torch.log(p) - 0.2 * torch.log(1 - p)
    out = dpo_loss(pairs, options)
    assert_parity(out.losses, expected, "cDPO loss")
    assert_parity(out.chosen_rewards, 0.3 * (pairs.chosen - pairs.ref_chosen), "DPO chosen reward")


def test_the_indifferent_losses() -> None:
    options = PreferenceOptions(beta=0.25, label_smoothing=0.1, simpo_gamma=0.7)
    assert_scalar_parity(indifferent_loss(dpo_loss, options), math.log(2), "DPO")
    assert_scalar_parity(indifferent_loss(ipo_loss, options), 1 / (4 * 0.25**2), "IPO")
    softplus = math.log1p(math.exp(0.7))  # -log sigma(-gamma)
    expected = 0.9 * softplus + 0.1 * math.log1p(math.exp(-0.7))
    assert_scalar_parity(indifferent_loss(simpo_loss, options), expected, "SimPO")
