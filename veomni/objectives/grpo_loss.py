"""The GRPO family's losses as pure functions of per-token log-probabilities and rewards.

For a prompt ``x`` the rollout samples a *group* of ``G`` completions ``y_1 .. y_G`` and scores
each with a reward ``r_i``. GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300) gives every
token of ``y_i`` the group-normalised advantage ``A_i = (r_i - mean(r)) / (std(r) + eps)`` (the
unbiased std of the group, ``eps`` 1e-4 as TRL); Dr. GRPO (Liu et al. 2025, arXiv:2503.20783)
drops the std scaling: ``A_i = r_i - mean(r)``.

Per completion token ``t`` with the policy's log-probability ``logp``, the rollout policy's
``old`` (the weights that generated it) and the ratio ``rho = exp(logp - old)``, the clipped
surrogate (PPO, with DAPO's separate low/high clips, Yu et al. 2025, arXiv:2503.14476) is
``l_t = -min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A)``; with a KL penalty to the
reference ``ref`` the token's loss is ``l_t + kl_coef * k(logp, ref)``, with Schulman's
estimators ``k1 = logp - ref`` and ``k3 = exp(ref - logp) - (ref - logp) - 1``.

The token losses are aggregated one of three ways (verl's ``loss_agg_mode`` names):

- ``token-mean``: the mean over every completion token of the step (DAPO; TRL's ``dapo``);
- ``seq-mean-token-mean``: each completion's mean over its tokens, then the mean over
  completions (the original GRPO; TRL's ``grpo``);
- ``seq-mean-token-sum-norm``: each completion's token sum divided by a constant (the longest
  completion the rollout may produce, ``rl.max_new_tokens``), then the mean over completions
  (Dr. GRPO; TRL's ``dr_grpo``).

``aggregate`` returns a *summed* loss and its loss units (tokens or completions), so the engine's
division by the global count of the step gives those means whatever the split into ranks and
micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k3")


@dataclass(frozen=True)
class GRPOOptions:
    clip_low: float = 0.2
    clip_high: float = 0.2
    """DAPO's clip-higher raises this one (0.28)."""
    aggregation: str = "token-mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    norm_length: int = 1
    """``seq-mean-token-sum-norm``'s divisor: the longest completion the rollout may produce."""


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """[N] rewards of consecutive groups of ``group_size`` -> [N] advantages: the reward minus its
    group's mean, divided by the group's unbiased std + ``eps`` when ``scale`` (GRPO), not (Dr. GRPO)."""
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not form groups of {group_size} (a group needs >= 2)")
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def kl_penalty(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per token: an estimate of KL(policy || reference) from the sampled token's log-probabilities."""
    delta = ref_logps - logps
    if estimator == "k1":
        return -delta
    if estimator == "k3":
        return torch.exp(delta) - delta - 1
    raise ValueError(f"unknown KL estimator {estimator!r}: one of {KL_ESTIMATORS}")


@dataclass(frozen=True)
class TokenTerms:
    loss: torch.Tensor
    """[T] each token's loss (differentiable): the clipped surrogate plus the weighted KL."""
    clipped: torch.Tensor
    """[T] bool: the clip is active (ratio below 1 - clip_low with A < 0, or above 1 + clip_high with A > 0)."""
    kl: torch.Tensor | None
    """[T] the KL estimate (detached); None without a reference."""


def token_terms(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                ref_logps: torch.Tensor | None, options: GRPOOptions) -> TokenTerms:
    """The per-token losses of completion tokens (all arguments [T], ``advantages`` per token)."""
    ratio = torch.exp(logps - old_logps)
    clipped_ratio = torch.clamp(ratio, 1 - options.clip_low, 1 + options.clip_high)
    loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    clipped = ((ratio < 1 - options.clip_low) & (advantages < 0)) | ((ratio > 1 + options.clip_high) & (advantages > 0))
    kl = None
    if ref_logps is not None:
        kl = kl_penalty(logps, ref_logps, options.kl_estimator)
        if options.kl_coef:
            loss = loss + options.kl_coef * kl
        kl = kl.detach()
    return TokenTerms(loss, clipped, kl)


def aggregate(sums: torch.Tensor, counts: torch.Tensor, options: GRPOOptions) -> tuple[torch.Tensor, int]:
    """Per completion [S]: its summed token loss and token count -> (summed loss, loss units) whose
    quotient, over a whole step, is the aggregation's mean."""
    if options.aggregation == "token-mean":
        return sums.sum(), int(counts.sum())
    if options.aggregation == "seq-mean-token-mean":
        return (sums / counts.clamp(min=1)).sum(), len(sums)
    if options.aggregation == "seq-mean-token-sum-norm":
        return (sums / options.norm_length).sum(), len(sums)
    raise ValueError(f"unknown aggregation {options.aggregation!r}: one of {AGGREGATIONS}")
