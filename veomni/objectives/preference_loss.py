"""Preference losses over pairs of replies: DPO, IPO and SimPO, as pure functions of sequence
log-probabilities.

For a pair (prompt x, chosen reply y_w, rejected reply y_l), ``log p(y|x)`` is the sum over the
reply's tokens of the model's log-probability of each token. With the policy ``pi`` and the frozen
reference ``ref``, the log-ratios are ``h_w = log pi(y_w|x) - log ref(y_w|x)`` and ``h_l`` alike.

- DPO (Rafailov et al. 2023, arXiv:2305.18290), sigmoid form with conservative label smoothing
  (Mitchell 2023, "cDPO"): ``-(1 - eps) log sigma(beta (h_w - h_l)) - eps log sigma(-beta (h_w - h_l))``.
  Rewards ``beta h``.
- IPO (Azar et al. 2023, arXiv:2310.12036, eq. 17): ``(h_w / |y_w| - h_l / |y_l| - 1 / (2 beta))^2``,
  the log-ratios averaged over each reply's tokens as TRL does (agreed with the paper's authors).
  Rewards ``beta h``.
- SimPO (Meng et al. 2024, arXiv:2405.14734): reference-free and length-normalised,
  ``-log sigma(beta (log pi(y_w|x) / |y_w| - log pi(y_l|x) / |y_l|) - gamma)``, with the same label
  smoothing as DPO. Rewards ``beta log pi(y|x) / |y|``.
- Any of them may add ``alpha`` times the chosen reply's negative log-likelihood per token,
  ``-log pi(y_w|x) / |y_w|`` (RPO: Pang et al. 2024, arXiv:2404.19733), which keeps raising the chosen
  reply itself once the preference loss is satisfied.

Each function returns one loss per pair and the pair's rewards; the caller sums and reports them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PairLogps:
    """Per pair [P]: the policy's summed log-probabilities of each reply, their token counts, and
    the reference's (None for a reference-free loss)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None


@dataclass(frozen=True)
class PreferenceOptions:
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    rpo_alpha: float = 0.0


@dataclass(frozen=True)
class PairLoss:
    losses: torch.Tensor
    """[P] one loss per pair (differentiable)."""
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    """[P] implicit rewards (detached)."""


def smoothed_sigmoid_loss(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """``-(1 - eps) log sigma(z) - eps log sigma(-z)``: the preferred reply wins with probability 1 - eps."""
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def _log_ratios(pairs: PairLogps) -> tuple[torch.Tensor, torch.Tensor]:
    if pairs.ref_chosen is None or pairs.ref_rejected is None:
        raise ValueError("this preference loss needs the reference model's log-probabilities")
    return pairs.chosen - pairs.ref_chosen, pairs.rejected - pairs.ref_rejected


def dpo_loss(pairs: PairLogps, options: PreferenceOptions) -> PairLoss:
    chosen, rejected = _log_ratios(pairs)
    losses = smoothed_sigmoid_loss(options.beta * (chosen - rejected), options.label_smoothing)
    return PairLoss(losses, options.beta * chosen.detach(), options.beta * rejected.detach())


def ipo_loss(pairs: PairLogps, options: PreferenceOptions) -> PairLoss:
    chosen, rejected = _log_ratios(pairs)
    delta = chosen / pairs.chosen_tokens.clamp(min=1) - rejected / pairs.rejected_tokens.clamp(min=1)
    losses = (delta - 1 / (2 * options.beta)) ** 2
    return PairLoss(losses, options.beta * chosen.detach(), options.beta * rejected.detach())


def simpo_loss(pairs: PairLogps, options: PreferenceOptions) -> PairLoss:
    chosen = pairs.chosen / pairs.chosen_tokens.clamp(min=1)
    rejected = pairs.rejected / pairs.rejected_tokens.clamp(min=1)
    losses = smoothed_sigmoid_loss(options.beta * (chosen - rejected) - options.simpo_gamma, options.label_smoothing)
    return PairLoss(losses, options.beta * chosen.detach(), options.beta * rejected.detach())


def chosen_nll(pairs: PairLogps) -> torch.Tensor:
    """[P] the chosen reply's negative log-likelihood per token: RPO's term (``rpo_alpha``)."""
    return -pairs.chosen / pairs.chosen_tokens.clamp(min=1)


PairLossFn = Callable[[PairLogps, PreferenceOptions], PairLoss]

PREFERENCE_LOSSES: dict[str, tuple[PairLossFn, bool]] = {
    "dpo": (dpo_loss, True),
    "ipo": (ipo_loss, True),
    "simpo": (simpo_loss, False),
}
"""Objective name -> (its loss, whether it needs the reference model)."""


def indifferent_loss(loss: PairLossFn, options: PreferenceOptions) -> float:
    """The loss of a policy that prefers neither reply (equal log-probabilities and lengths, equal to
    the reference's): ``ln 2`` for DPO, ``1 / (4 beta^2)`` for IPO, ``-log sigma(-gamma)`` for SimPO."""
    zero, one = torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    return float(loss(PairLogps(zero, zero, one, one, zero, zero), options).losses[0])
