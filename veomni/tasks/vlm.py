"""The task of vision(-audio)-language models: next-token loss on the answer tokens, with media
fed to the encoders.

The data pipeline already sets ``labels`` to -100 everywhere but on assistant tokens (and on
placeholder tokens, which are never targets), so this is the language-modelling loss with the
batch's ``media`` passed through. ``answer_token_acc`` (greedy next-token accuracy on the loss
tokens) is reported alongside: on one-word answers it tracks answer accuracy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from veomni.tasks.base import IGNORE_INDEX, LossOutput, RowPlacement
from veomni.tasks.lm import LM_CONTRACT, LanguageModelingTask


def localize_media(batch: Mapping[str, Any], placement: RowPlacement) -> dict[str, Any]:
    """One rank's ``media`` when ranks split the row: every modality keeps the whole row's encoder
    inputs (the ranks share the encoding, ``veomni/parallel/media/colocate.py``); ``positions`` become
    the placeholders in this rank's slice, in local coordinates and feature-row order, and
    ``holders`` the row rank holding each of the row's feature rows."""
    if "media" not in batch:
        return {}
    media = {}
    for name, entry in batch["media"].items():
        holders = placement.holder[entry["positions"]]
        here = entry["positions"][holders == placement.rank]
        media[name] = {**entry, "positions": placement.local[here], "holders": holders}
    return {"media": media}


VLM_CONTRACT = dataclasses.replace(LM_CONTRACT, media="media", localize=localize_media)
"""The packed text row of ``LM_CONTRACT`` plus ``media`` (per modality: the encoder inputs and the
placeholder positions); on a pipeline the first stage splices the features
(``veomni/parallel/media/pipeline_encoders.py``)."""


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
