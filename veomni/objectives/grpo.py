"""The GRPO policy update (``train.objective: grpo``) on packed rollout rows.

A rollout micro-batch (``rollout.py`` builds it) is a packed row of samples, each one prompt with
one sampled completion, labels only on the completion, and per position the completion's
advantage (``advantages``, a sequence field, 0 off the completion). The family's task gives the
logits; this task turns them into per-token log-probabilities and the losses of ``grpo_loss.py``.

The rollout's log-probabilities ``old`` are those of the weights that generated it. A rollout batch
is one optimizer step, updated ``rl.updates_per_rollout`` times in a row, so the first update of a
batch runs exactly those weights: its forward's log-probabilities, detached, *are* ``old`` (as TRL
takes them), and they are kept (with the reference's, computed once) for the later updates of the
same batch, keyed by the micro-batch's ``rollout_key``. Sums per completion are completed over the
ranks sharing a row (``sequence_logps.py``). Metrics, means over completion tokens: ``clip_fraction``,
``kl`` (the chosen estimator, against the reference), ``entropy`` (of the policy's next-token
distribution), ``ratio``.
"""

from __future__ import annotations

import torch
from torch import nn

from veomni.objectives.grpo_loss import GRPOOptions, aggregate, kl_penalty, token_terms
from veomni.objectives.sequence_logps import SAMPLE_INDEX, LogitsTask, SequenceLogpsTask, sample_index
from veomni.tasks.base import Baseline, LossOutput

ADVANTAGES = "advantages"
"""Sequence field: each position's advantage (its completion's; 0 where there is no target)."""
ROLLOUT_KEY = "rollout_key"
"""Batch field: (rollout index, micro-batch index), which names a micro-batch across its updates."""


class GRPOTask(SequenceLogpsTask):
    """The family's ``LogitsTask`` trained on rollouts with the clipped GRPO surrogate."""

    def __init__(self, inner: LogitsTask, options: GRPOOptions) -> None:
        super().__init__(inner, {ADVANTAGES: 0.0})
        self.options = options
        self._fixed: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        """The rollout under update: micro-batch key -> (old log-probabilities, the reference's)."""

    def prepare(self, batch: dict, generator: torch.Generator | None = None, training: bool = True) -> dict:
        batch = self.inner.prepare(batch, generator, training)
        return {**batch, SAMPLE_INDEX: sample_index(batch["cu_seqlens"])}

    def count_loss_units(self, batch: dict) -> int:
        return int(self.targets(batch).sum()) if self.options.aggregation == "token-mean" \
            else int(batch["cu_seqlens"].numel()) - 1

    def fixed_logps(self, batch: dict, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(old, reference) log-probabilities of the micro-batch: taken on its first update, kept for the
        rest of its rollout's updates."""
        key = tuple(batch.get(ROLLOUT_KEY, (-1, -1)))
        if key not in self._fixed or key[0] < 0:
            if any(seen[0] != key[0] for seen in self._fixed):
                self._fixed.clear()  # a new rollout: the last one's values are spent
            with torch.no_grad():
                ref = self.reference(batch) if self.reference is not None else None
            self._fixed[key] = (logps.detach(), ref)
        return self._fixed[key]

    def __call__(self, model: nn.Module, batch: dict) -> LossOutput:
        logits = self.inner.forward(model, batch)
        logps = self.target_logps(logits, batch)
        old, ref = self.fixed_logps(batch, logps)
        terms = token_terms(logps, old, batch[ADVANTAGES], ref, self.options)
        sums, counts = self.sample_sums(terms.loss, batch)
        loss_sum, units = aggregate(sums, counts, self.options)
        targets = self.targets(batch)
        tokens = int(targets.sum())
        with torch.no_grad():
            log_probs = torch.log_softmax(logits[targets].float(), dim=-1)
            entropy = -(log_probs.exp() * log_probs).sum()
            metrics = {"clip_fraction": terms.clipped[targets].sum(), "entropy": entropy,
                       "ratio": torch.exp(logps - old)[targets].sum()}
            if ref is not None:
                metrics["kl"] = kl_penalty(logps, ref, self.options.kl_estimator)[targets].sum()
        return LossOutput(loss_sum, units, {name: (value, tokens) for name, value in metrics.items()})

    def baseline_stats(self, batch: dict) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.float64)

    def baseline_loss(self, stats: torch.Tensor) -> Baseline | None:
        return None

