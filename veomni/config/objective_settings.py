"""The objectives' settings sections (``preference``, ``rl``; docs/post_training.md), beside the schema."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class PreferenceConfig:
    """The preference objectives' settings (``train.objective: dpo | ipo | simpo``, docs/post_training.md)."""

    beta: float = 0.1
    """DPO / IPO: strength of the pull towards the reference (IPO's tau); SimPO: the reward scale."""
    label_smoothing: float = 0.0
    """DPO / SimPO: the probability that a pair's preference is flipped (conservative DPO); in [0, 0.5)."""
    simpo_gamma: float = 0.5
    """SimPO: the target reward margin gamma."""
    rpo_alpha: float = 0.0
    """Weight of the chosen reply's negative log-likelihood (mean over its tokens) added to each pair's
    loss (RPO, TRL's ``loss_type=["sigmoid", "sft"]`` with ``loss_weights=[1, alpha]``); 0: none."""


@dataclass
class RLConfig:
    """Online RL with verifiable rewards (``train.objective: grpo``, docs/post_training.md)."""

    group_size: int = 4
    """Completions sampled per prompt (a group: its rewards normalise each other's advantage); >= 2."""
    max_new_tokens: int = 32
    """The longest completion; also Dr. GRPO's divisor (``aggregation: seq-mean-token-sum-norm``)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (> 0)."""
    top_p: float = 1.0
    """Nucleus cut of the rollouts' sampling, in (0, 1]."""
    top_k: int = 0
    """Top-k cut of the rollouts' sampling (0: none)."""
    updates_per_rollout: int = 1
    """Optimizer steps taken on each rollout batch (PPO epochs; > 1 makes the clip act)."""
    clip_low: float = 0.2
    """The ratio's lower clip: 1 - clip_low."""
    clip_high: float = 0.2
    """The ratio's upper clip: 1 + clip_high (DAPO's clip-higher: 0.28)."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How token losses become the step's loss (DAPO's token mean; GRPO's mean of sequence means; Dr. GRPO's
    token sums over ``max_new_tokens``)."""
    scale_rewards: bool = True
    """Divide each advantage by its group's reward std (GRPO); false: Dr. GRPO."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (the starting model); 0: no reference is held."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """The per-token KL estimate: k1 = log pi - log ref, k3 = exp(ref - pi) - (ref - pi) - 1."""
    rewards: list[str] = field(default_factory=lambda: ["veomni.objectives.rewards.exact_match"])
    """Reward functions by dotted path ``package.module.function`` (``veomni/objectives/rewards.py``); summed."""
    reward_weights: list[float] = field(default_factory=list)
    """One weight per reward (empty: all 1)."""
    rollout_engine: str = "builtin"
    """What generates the rollouts, by registered name (``veomni/objectives/rollout_engines.py``):
    ``builtin`` (the trained model in the training processes) or ``vllm`` (an engine per rank on its GPU,
    the trained weights pushed in after every update); a plug-in may register more."""
    rollout_engine_memory: float = 0.3
    """An external engine's share of its device's memory for its weights and KV cache (vLLM's
    ``gpu_memory_utilization``), in (0, 1); the built-in engine ignores it."""
