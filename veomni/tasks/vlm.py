"""The task of vision(-audio)-language models: next-token loss on the answer tokens, with media
fed to the encoders.

The data pipeline already sets ``labels`` to -100 everywhere but on assistant tokens (and on
placeholder tokens, which are never targets), so this is the language-modelling loss with the
batch's ``media`` passed through. ``answer_token_acc`` (greedy next-token accuracy on the loss
tokens) is reported alongside: on one-word answers it tracks answer accuracy.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from veomni.tasks.base import IGNORE_INDEX, LossOutput
from veomni.tasks.lm import LM_CONTRACT, LanguageModelingTask

VLM_CONTRACT = dataclasses.replace(LM_CONTRACT, media="media")
"""The packed text row of ``LM_CONTRACT`` plus ``media`` (per modality: the encoder inputs and the
placeholder positions); on a pipeline the first stage splices the features
(``veomni/parallel/pipeline_media.py``)."""


class VLMTask(LanguageModelingTask):
    contract = VLM_CONTRACT

    def forward(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], batch["max_seqlen"],
                     media=batch.get("media"))

    def __call__(self, model: nn.Module, batch: dict) -> LossOutput:
        logits = self.forward(model, batch)
        out = LossOutput(self.output_loss(logits, batch["labels"]), self.count_loss_units(batch))
        targets = batch["labels"] != IGNORE_INDEX
        correct = (logits.detach().argmax(-1) == batch["labels"])[targets].sum()
        out.metrics["answer_token_acc"] = (correct.float(), out.loss_units)
        return out
