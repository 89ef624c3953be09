"""The task of omni models: next-token loss on the answer tokens, with media fed to the encoders.

The data pipeline already sets ``labels`` to -100 everywhere but on assistant tokens (and on
placeholder tokens, which are never targets), so this is the language-modelling loss with the
batch's ``media`` passed through. ``answer_token_acc`` (greedy next-token accuracy on the loss
tokens) is reported alongside: on one-word answers it tracks answer accuracy.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from veomni.train.tasks import IGNORE_INDEX, LanguageModelingTask, LossOutput


class OmniTask(LanguageModelingTask):
    def __call__(self, model: nn.Module, batch: dict) -> LossOutput:
        logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], batch["max_seqlen"],
                       media=batch.get("media"))
        labels = batch["labels"]
        loss_sum = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
        targets = labels != IGNORE_INDEX
        correct = (logits.detach().argmax(-1) == labels)[targets].sum()
        num_tokens = int(targets.sum())
        return LossOutput(loss_sum=loss_sum, num_tokens=num_tokens,
                          metrics={"answer_token_acc": (correct.float(), num_tokens)})
