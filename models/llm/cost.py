"""Cost model of the decoder-LM families over packed token rows: the models' own formulas
(``training_flops``, ``activation_bytes_per_token``, ``activated_params``) behind the engine's
typed ``CostModel``. VWN and omni specs subclass it for their ``--dry-run`` lines and, for
omni models, the encoders' work on a micro-batch's media."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn


class LMCost:
    """Units are tokens; a micro-batch's samples are its ``cu_seqlens`` segments."""

    def batch_flops(self, model: nn.Module, batch: Mapping[str, Any]) -> float:
        return model.training_flops(batch["cu_seqlens"].diff().tolist())

    def sample_flops(self, model: nn.Module, units: int) -> float:
        return model.training_flops([units])

    def activation_bytes_per_unit(self, model: nn.Module, bytes_per_elem: int, checkpointing: str) -> float:
        return model.activation_bytes_per_token(bytes_per_elem, checkpointing)

    def activated_params(self, model: nn.Module) -> int:
        return model.activated_params()

    def report_lines(self, model: nn.Module, units: int) -> list[str]:
        return []
