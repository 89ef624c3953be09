"""Language modelling with multi-token prediction: next-token plus weighted next-2-token CE.

For models whose ``forward(..., mtp=True)`` returns ``(logits, mtp_logits)``, where row i of
``mtp_logits`` predicts token i+2 of the same sample (DeepSeek-V3 / VWN MTP of depth 1).

Normalisation: the training loss is ``(sum CE_ntp + w * sum CE_mtp) / N`` with N the step's
global count of next-token targets, the one count the step already all-reduces, so FSDP and
gradient-accumulation parity hold unchanged. A sample of length L has L-1 next-token but L-2
next-2-token targets, so the MTP term's effective weight is ``w * N_mtp / N`` (slightly below
w). The reported ``loss_ntp`` and ``loss_mtp`` are exact means over their own targets.

The baseline weighs the two terms the same way: ``H_ntp + w * N_mtp / N * H_mtp``, with H the
unigram entropy of each term's eval targets.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from veomni.tasks.base import IGNORE_INDEX, Baseline, LossOutput
from veomni.tasks.lm import LM_CONTRACT, LanguageModelingTask, target_counts, unigram_entropy

MTP_CONTRACT = dataclasses.replace(
    LM_CONTRACT,
    sequence_fields=(*LM_CONTRACT.sequence_fields, "mtp_labels", "mtp_next_ids"),
    pad_values={**LM_CONTRACT.pad_values, "mtp_labels": IGNORE_INDEX},
    stage_input=None,  # the next-2-token head needs the first stage's embedding on the last stage
)


def next_two_token_labels(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Targets two ahead: ``labels[i + 1]`` where i+1 is in i's sample, else -100.

    ``labels`` are already shifted by one (next token within the sample, -100 at its end).
    """
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:-1] = labels[1:]
    out[cu_seqlens[1:].long() - 1] = IGNORE_INDEX  # a sample's last row: i+1 is another sample
    return out


class MultiTokenLMTask(LanguageModelingTask):
    """Next-token CE plus ``mtp_weight`` x next-2-token CE; both reported as metrics."""

    contract = MTP_CONTRACT

    def __init__(self, mtp_weight: float) -> None:
        self.mtp_weight = float(mtp_weight)

    def prepare(self, batch: dict, generator: torch.Generator | None = None, training: bool = True) -> dict:
        """Look-ahead tensors from the whole row, so a sequence-parallel slice sees its
        neighbour's first tokens: the next-2 targets, and the next token feeding each row's MTP
        input (the label itself, where the row has one)."""
        labels = batch["labels"]
        return {**batch, "mtp_labels": next_two_token_labels(labels, batch["cu_seqlens"]),
                "mtp_next_ids": torch.where(labels == IGNORE_INDEX, batch["input_ids"], labels)}

    def __call__(self, model: nn.Module, batch: dict) -> LossOutput:
        if "mtp_labels" not in batch:
            batch = self.prepare(batch)
        logits, mtp_logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"],
                                   batch["max_seqlen"], mtp=True, next_ids=batch["mtp_next_ids"],
                                   valid_tokens=batch.get("valid_tokens"))
        mtp_labels = batch["mtp_labels"]
        ntp = F.cross_entropy(logits.float(), batch["labels"], ignore_index=IGNORE_INDEX, reduction="sum")
        mtp = F.cross_entropy(mtp_logits.float(), mtp_labels, ignore_index=IGNORE_INDEX, reduction="sum")
        num_tokens = self.count_loss_units(batch)
        return LossOutput(
            loss_sum=ntp + self.mtp_weight * mtp,
            loss_units=num_tokens,
            metrics={"loss_ntp": (ntp.detach(), num_tokens),
                     "loss_mtp": (mtp.detach(), int((mtp_labels != IGNORE_INDEX).sum()))},
        )

    def baseline_stats(self, batch: dict) -> torch.Tensor:
        """Target counts per token id: row 0 of the next-token term, row 1 of the next-2-token term."""
        if "mtp_labels" not in batch:
            batch = self.prepare(batch)
        ntp, mtp = target_counts(batch["labels"]), target_counts(batch["mtp_labels"])
        size = max(len(ntp), len(mtp))
        return torch.stack([F.pad(ntp, (0, size - len(ntp))), F.pad(mtp, (0, size - len(mtp)))])

    def baseline_loss(self, stats: torch.Tensor) -> Baseline | None:
        ntp, mtp = unigram_entropy(stats[0]), unigram_entropy(stats[1])
        if ntp is None:
            return None
        mtp_share = float(stats[1].sum() / stats[0].sum())
        meaning = (f"the loss of predicting every target token from how often it occurs among the eval "
                   f"targets themselves (unigram entropy), next-token term plus {self.mtp_weight:g} x "
                   f"next-2-token term as in the loss, which nothing that ignores context can beat; below "
                   f"it, the model uses context")
        return Baseline(ntp + self.mtp_weight * mtp_share * (mtp or 0.0), "token frequencies alone", meaning,
                        unit="nats")
